"""The vLLM engine's adapter slot for a LoRA run: the base stays loaded, each version's adapter is swapped in.

The engine starts with an all-zero adapter in its one slot (the base's own
outputs, version 0), and every request goes with that slot. A new version is a
PEFT adapter folder: checked against the adapter ``learner.lora`` makes,
pinned in a private copy, and loaded into the slot in place; requests in
flight go on with it from the engine's next step. A folder that does not fit
is refused, and the adapter serving keeps serving.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.weights import adapters, folders
from generators import vllm_compat
from generators.base import within
from generators.staging import checkpoint_spec

if TYPE_CHECKING:
    from asyncrl.config import LoraConfig

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
        private = folders.private_folder(Path(stage_dir or tempfile.gettempdir()), "asyncrl-vllm-")
        self.staged = adapters.write_zero_adapter(fresh, private / "v000000.zero-adapter")
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
        shutil.rmtree(self.staged, ignore_errors=True)
