"""The vLLM engine's adapter slot for a LoRA run: the base stays loaded, each version's adapter is swapped in.

The engine starts with an all-zero adapter in its one slot (the base's own
outputs, version 0), and every request goes with that slot. A new version is a
PEFT adapter folder: checked against the adapter ``learner.lora`` makes,
pinned in a private copy, and loaded into the slot in place; requests in
flight go on with it from the engine's next step. A folder that does not fit
is refused, and the adapter serving keeps serving.

A version pushed over the process group (``push.address``) or shared in
memory (``learner.shared_weights``, CUDA IPC on one GPU) arrives as tensors
(:class:`AdapterWire`); vLLM loads adapters from a path, so they are checked
the same way and written as a PEFT folder in memory (``/dev/shm``) for the
slot to load: a few megabytes, not a second copy of the model.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.weights import adapters, folders
from asyncrl.weights.push import open_group
from asyncrl.weights.shared import ViewCache
from generators import vllm_compat
from generators.base import within
from generators.staging import checkpoint_spec

if TYPE_CHECKING:
    import torch

    from asyncrl.config import LoraConfig, PushConfig
    from asyncrl.wire.protocol import SharedHandle

SLOT = "asyncrl-policy"  # the engine's one adapter, every version swapped into it


def engine_args(*loras: LoraConfig) -> dict[str, Any]:
    """``vllm.LLM`` arguments for one adapter slot per ``learner.lora`` (several: a pool's runs)."""
    rank = max(lora.rank for lora in loras)
    return {"enable_lora": True, "max_lora_rank": adapters.vllm_max_lora_rank(rank), "max_loras": len(loras)}


class AdapterSlot:
    """A slot of an engine started with :func:`engine_args`; ``request`` goes with every prompt that uses it.

    ``name`` and ``slot_id`` tell a pool's slots apart (vLLM's adapter name and its id, from 1).
    """

    def __init__(
        self, llm: Any, lora: LoraConfig, model_path: str, stage_dir: str | None, name: str = SLOT, slot_id: int = 1
    ) -> None:
        self.llm, self.name, self.slot_id = llm, name, slot_id
        fresh = adapters.meta_adapter(lora, model_path)
        self.spec = adapters.adapter_shapes(fresh)
        self.config_json = adapters.adapter_config_json(fresh)
        self._received = itertools.count()
        self.private = folders.private_folder(Path(stage_dir or memory_dir()), f"asyncrl-vllm-{name}-")
        self.staged = adapters.write_zero_adapter(fresh, self.private / "v000000.zero-adapter")
        self.request = vllm_compat.swap_adapter(llm, name, str(self.staged), slot_id)

    def load(self, folder: Path, version: int, timeout_s: float, stage: Callable[[Path, int], Path]) -> None:
        """Swap in the PEFT adapter folder of ``version``, or raise and keep the current one."""
        self.swap_in(self.prepare(folder, version, timeout_s, stage), version)

    def prepare(self, folder: Path, version: int, timeout_s: float, stage: Callable[[Path, int], Path]) -> Path:
        """Check the adapter folder of ``version`` against this slot and stage a private copy (the engine
        untouched); the copy."""

        def check_and_stage() -> Path:
            if not (folder / adapters.ADAPTER_FILE).exists():
                raise FileNotFoundError(f"weights v{version}: {folder}/{adapters.ADAPTER_FILE} is missing")
            folders.check_shapes(self.spec, checkpoint_spec(folder), version)
            return stage(folder, version)

        return within(timeout_s, f"checking and staging adapter v{version}", check_and_stage)

    def stage_tensors(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> Path:
        """Check a received adapter of ``version`` against this slot and write it as a PEFT folder to swap in."""
        folders.check_shapes(self.spec, {name: tuple(t.shape) for name, t in tensors}, version)
        folder = self.private / f"v{version:06d}.received-{next(self._received)}"  # a version may come again
        folders.write_adapter_folder(tensors, folder, self.config_json)
        return folder

    def swap_in(self, staged: Path, version: int) -> None:
        r"""Load a :meth:`prepare`\ d copy into the engine, or raise and keep the current adapter."""
        try:
            self.request = vllm_compat.swap_adapter(self.llm, self.name, str(staged), self.slot_id)
        except Exception as error:  # the swap loads the new weights first: the current adapter keeps serving
            shutil.rmtree(staged, ignore_errors=True)
            raise RuntimeError(f"weights v{version}: engine failed to load the adapter: {error}") from error
        shutil.rmtree(self.staged, ignore_errors=True)
        self.staged = staged

    def close(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)


def engine_device() -> str:
    """The device this process's engine runs on, where received adapters land (the first GPU it sees)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def memory_dir() -> str:
    """Where received adapters are written for the engine to read: memory where the system offers it."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


class AdapterWire:
    """How pushed and shared adapter versions reach this process for one slot: the run's push group (joined at
    the first push, as rank ``push_rank``: one per engine, whatever its tensor parallel size, as vLLM's LoRA
    loader shards an adapter itself) and the learner's shared segment."""

    def __init__(self, push: PushConfig | None, push_rank: int, device: str) -> None:
        self.push, self.push_rank, self.device = push, push_rank, device
        self._group = None
        self._views = ViewCache()

    def pushed(self, epoch: int, version: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """The tensors of push ``epoch`` and the version they are."""
        if self.push is None or self.push.address is None:
            raise ValueError(f"weights v{version} are pushed but push.address is not set")
        if self._group is None:
            self._group = open_group(self.push, self.push_rank, self.device)
        manifest, tensors = self._group.receive(epoch, version)
        return list(tensors), manifest.version

    def shared(self, handle: SharedHandle, version: int, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """A private copy of ``version`` out of the learner's segment."""
        return list(self._views.view(handle, self.device).read(version, timeout_s))
