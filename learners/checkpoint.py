"""Learner checkpoints: DeepSpeed state plus everything that makes resume exact.

A checkpoint ``checkpoints/step00000120/`` holds the DeepSpeed engine state
(partitioned parameters, gradients' optimizer states), each rank's RNG state,
and, from rank 0, :class:`LearnerState`: step, policy version, the prompt
cursor and tickets out, staleness counters and the ids of every rollout
trained on. ``checkpoints/LATEST`` names the newest complete checkpoint; it is
replaced atomically only after every rank has finished writing, so a crash
mid-save leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from asyncrl.control.coordinator import CoordinatorState

if TYPE_CHECKING:
    from asyncrl.config import LoraConfig

log = logging.getLogger(__name__)

LATEST = "LATEST"


class LearnerState(msgspec.Struct):
    """Rank 0's bookkeeping, saved next to the engine state."""

    step: int
    version: int
    coordinator: CoordinatorState
    bound: dict[str, object]
    consumed_ids: list[str]
    # Samples seen by response-length bucket and verdict (fresh, stale...): the summary's staleness_by_length.
    by_length: dict[int, dict[str, int]] = {}
    # Held-out evaluations not finished at the checkpoint, (version, step); version -1: owed to the next version.
    evals: list[tuple[int, int]] = []


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def save(engine, directory: Path, step: int, state: LearnerState | None, rank: int, keep: int, critic=None) -> Path:
    """Write a checkpoint of ``step`` collectively; ``state`` is rank 0's, ``critic`` the value model's engine.

    The checkpoint in charge (the one ``LATEST`` names) is never written
    over: a kill mid-write would leave ``LATEST`` naming a torn folder. A
    folder of the same step that ``LATEST`` does not name (a discarded
    timeline's, or a save that crashed before ``LATEST`` moved) is removed
    first, so that none of its files mixes with this save's.
    """
    from safetensors.torch import save_file

    tag = tag_of(step)
    folder = directory / tag
    if latest(directory) == tag:
        raise ValueError(f"{folder} is the checkpoint in charge ({directory / LATEST}): it is never written over")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    if critic is not None:  # inside the step's folder, before LATEST can point at it
        critic.save_checkpoint(str(folder), tag="critic", save_latest=False)
    engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, folder / f"rng_rank{rank}.safetensors")
    if rank == 0:
        (folder / "asyncrl_state.json").write_bytes(msgspec.json.encode(state))
    dist.barrier()
    if rank == 0:
        tmp = directory / (LATEST + ".tmp")
        tmp.write_text(tag)
        os.replace(tmp, directory / LATEST)
        _prune(directory, step, keep)
    dist.barrier()
    return folder


def _prune(directory: Path, step: int, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints up to ``step`` and none after it.

    Checkpoints numbered past ``step`` belong to a future this run discarded (an
    earlier run in the same folder, a resume from an older checkpoint, a save
    that crashed before ``LATEST`` moved): counted among the newest, they would
    crowd out the checkpoint just written. The checkpoint of ``step``, which
    ``LATEST`` names, is never removed.
    """
    steps = {int(p.name[4:]): p for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()}
    kept = sorted((s for s in steps if s <= step), reverse=True)[:keep]
    for number, path in steps.items():
        if number not in kept and number != step:
            shutil.rmtree(path, ignore_errors=True)


def latest(directory: Path) -> str | None:
    """The tag of the newest complete checkpoint, if any."""
    pointer = directory / LATEST
    return pointer.read_text().strip() if pointer.exists() else None


def load(engine, directory: Path, rank: int) -> LearnerState:
    """Restore the engine and this rank's RNG from the newest checkpoint."""
    from safetensors.torch import load_file

    tag = latest(directory)
    if tag is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {directory} (no {LATEST} file)")
    path, _ = engine.load_checkpoint(str(directory), tag=tag)
    if path is None:
        raise RuntimeError(f"--resume: DeepSpeed could not load {directory / tag}")
    rng = load_file(directory / tag / f"rng_rank{rank}.safetensors")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    state = msgspec.json.decode((directory / tag / "asyncrl_state.json").read_bytes(), type=LearnerState)
    log.info("resumed from %s: step %d, version %d", directory / tag, state.step, state.version)
    return state


def truncate_log(path: Path, step: int, ordered: bool = True, keep_later: Callable[[dict], bool] | None = None) -> None:
    """Drop a JSONL log's records after ``step``: they belong to an undone timeline. A step-ordered log
    (``ordered``) is cut at its first later record; another (evaluations, which finish out of order) keeps
    every record of a step up to ``step``, and with ``keep_later`` the later records it says stand.

    A line that is not a whole record (a process killed or a disk filled while
    it was appended, so it does not parse or lacks its newline) ends the log
    there too: what follows it cannot be trusted, and a record appended after
    it would be glued to it. Rewritten in place, so files already open for
    appending keep working.
    """
    if not path.exists():
        return
    kept: list[bytes] = []
    with open(path, "rb+") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                record = None
            if record is None:
                if line.strip():
                    log.warning(
                        "%s: line %d is not a whole record (cut off mid-write?); the log ends before it", path, number
                    )
                break
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}, line {number}: not a record of a learner step (no integer 'step')")
            if record["step"] > step:
                if ordered:
                    break
                if keep_later is None or not keep_later(record):
                    continue
            kept.append(line)
        f.seek(0)
        f.write(b"".join(kept))
        f.truncate()


def export_hf(
    directory: Path,
    tag: str | None,
    model_dir: str,
    out: Path,
    dtype: str,
    lora: LoraConfig | None = None,
    merged: bool = False,
) -> Path:
    """Write checkpoint ``tag`` (default: the newest) of ``directory`` as an HF folder at ``out``.

    DeepSpeed's own ``zero_to_fp32`` reassembles the fp32 master weights from
    every rank's ZeRO shards, offline: no GPU and no process group needed.
    With one rank (no ZeRO, or DeepSpeed's bf16 optimizer) the module's saved state dict is the model, in
    the weights' own dtype.
    A LoRA learner's checkpoint (``lora`` on) is written as a PEFT adapter
    folder, or with ``merged`` as the base with the adapter merged in.
    """
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    from asyncrl.weights import folders

    tag = tag or latest(directory)
    if tag is None or not (directory / tag).is_dir():
        tags = sorted(p.name for p in directory.glob("step*") if p.is_dir()) if directory.is_dir() else []
        versions = sorted((directory.parent / "weights").glob("v[0-9]*"))
        raise FileNotFoundError(
            f"--export: no checkpoint {tag or LATEST!r} under {directory}"
            + (f" (there are: {', '.join(tags)})" if tags else "")
            + (f"; the published versions are HF folders already: {versions[-1]}" if versions else "")
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--export: {out} exists and is not empty")
    if zero_sharded(directory / tag):
        full = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    else:  # ZeRO stage 0 or one bf16 rank: the module's own state dict holds the whole model
        states = torch.load(directory / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        full = states["module"]
    prefix = "model."  # the engine's root module holds the HF model as .model
    target = getattr(torch, dtype)
    state = {
        name[len(prefix) :]: tensor.to(target) if tensor.is_floating_point() else tensor
        for name, tensor in full.items()
        if name.startswith(prefix)
    }
    if lora is not None and lora.enabled:
        return export_adapter(state, lora, model_dir, out, merged, tag)
    if AutoConfig.from_pretrained(model_dir).tie_word_embeddings:
        state.pop("lm_head.weight", None)  # from_pretrained ties it to the embedding again
    config_json = (Path(model_dir) / "config.json").read_text()
    folders.write_folder(state.items(), out, model_dir, config_json, {"asyncrl_checkpoint": tag})
    log.info("exported %s (%d tensors) to %s", directory / tag, len(state), out)
    return out


def written_without_zero(directory: Path) -> bool:
    """Whether the newest checkpoint under ``directory`` was written by a learner without ZeRO (stage 0): the
    module's state only, no optimizer shards of any kind."""
    tag = latest(directory)
    return tag is not None and (directory / tag).is_dir() and not any((directory / tag).glob("*zero_pp_rank_*"))


def zero_sharded(folder: Path) -> bool:
    """Whether checkpoint ``folder`` holds ZeRO's optimizer shards, which ``zero_to_fp32`` reassembles.

    DeepSpeed's bf16 optimizer (one bf16 rank) writes files of the same names (``bf16_zero_pp_rank_*``) in a
    format of its own; like zero_to_fp32, this tells them apart by the ``zero_stage`` ZeRO records.
    """
    shards = sorted(folder.glob("*zero_pp_rank_*optim_states.pt"))
    if not shards:
        return False
    state = torch.load(shards[0], map_location="cpu", mmap=True, weights_only=False)
    return "zero_stage" in state.get("optimizer_state_dict", {})


def export_adapter(state: dict, lora: LoraConfig, model_dir: str, out: Path, merged: bool, tag: str) -> Path:
    """A LoRA checkpoint's adapter as a PEFT folder at ``out``; with ``merged``, the base with it merged in."""
    import tempfile

    from asyncrl.weights import adapters, folders

    adapter = adapters.adapter_state(state)
    if not adapter:
        raise ValueError(f"--export: checkpoint {tag} holds no LoRA adapter; is learner.lora set as it was trained?")
    config_json = adapters.adapter_config_for(lora, model_dir)
    if not merged:
        folders.write_adapter_folder(adapter.items(), out, config_json, {"asyncrl_checkpoint": tag})
        log.info("exported the adapter of checkpoint %s to %s", tag, out)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        folders.write_adapter_folder(adapter.items(), Path(tmp) / "adapter", config_json)
        model = adapters.merge(model_dir, Path(tmp) / "adapter")
    config_json = (Path(model_dir) / "config.json").read_text()
    whole = {
        k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    folders.write_folder(whole.items(), out, model_dir, config_json, {"asyncrl_checkpoint": tag})
    log.info("exported checkpoint %s, its adapter merged into the base, to %s", tag, out)
    return out
