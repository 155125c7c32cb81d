"""Versioned weight hand-off between learners and generators (file transport).

The learner writes version ``v`` as a complete HF-format folder (config,
safetensors, tokenizer) under ``weights_dir/v000007`` and announces it with a
:class:`~asyncrl.wire.protocol.WeightUpdate`. The folder is written under a
temporary name and renamed into place, and rename is atomic within a file
system: a reader sees all of version ``v`` or none of it. Every folder loads
with ``transformers.AutoModelForCausalLM.from_pretrained``. Put
``weights_dir`` on ``/dev/shm`` to keep the hand-off in memory.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.wire.protocol import WeightUpdate, now_s

if TYPE_CHECKING:
    import torch

# What a version folder takes from the model folder besides the weights, where the model has them: a model
# without a tokenizer.json loads its tokenizer from the others (SentencePiece, BPE vocabulary and merges).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


# A LoRA learner's version is a PEFT adapter folder: these two files (asyncrl.weights.adapters).
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """Where version ``version`` lives (or will) under ``weights_dir``: ``v000007``, zero-padded so that
    the folders sort by version."""
    return Path(weights_dir) / f"v{version:06d}"


def publish(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    weights_dir: str | Path,
    model_dir: str | Path,
    config_json: str,
    keep_versions: int = 3,
    adapter_config_json: str | None = None,
) -> WeightUpdate:
    """Write ``tensors`` as version ``version`` atomically and return its announcement.

    ``tensors`` may be a generator that gathers parameters bucket by bucket;
    tensors are copied to CPU as they come. Tokenizer files are copied from
    ``model_dir`` so that the folder is self-contained. With
    ``adapter_config_json`` the tensors are a LoRA adapter and the folder a PEFT adapter folder.
    """
    final = version_dir(weights_dir, version)
    metadata = {"asyncrl_version": str(version)}
    if adapter_config_json is None:
        state = write_folder(tensors, final, model_dir, config_json, metadata)
    else:
        state = write_adapter_folder(tensors, final, adapter_config_json, metadata)
    _prune(Path(weights_dir), keep_versions)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return WeightUpdate(version=version, uri=final.resolve().as_uri(), num_bytes=num_bytes, published_s=now_s())


def write_folder(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: str | Path,
    model_dir: str | Path,
    config_json: str,
    metadata: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write an HF folder (safetensors, config, tokenizer files from ``model_dir``) atomically.

    The folder appears complete or not at all (written next to it, then
    renamed). Returns the CPU state dict that was written.
    """
    from safetensors.torch import save_file

    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    (tmp / "config.json").write_text(config_json)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            _link_or_copy(Path(model_dir) / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return state


def write_adapter_folder(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: str | Path,
    adapter_config_json: str,
    metadata: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a PEFT adapter folder (``adapter_model.safetensors``, ``adapter_config.json``) atomically.
    Returns the CPU state dict that was written."""
    from safetensors.torch import save_file

    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    save_file(state, tmp / ADAPTER_FILE, metadata={"format": "pt", **(metadata or {})})
    (tmp / ADAPTER_CONFIG).write_text(adapter_config_json)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return state


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (the files never change), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def discard_after(weights_dir: str | Path, version: int) -> None:
    """Delete published versions newer than ``version``.

    A learner resumed from a checkpoint at ``version`` undoes every later
    step; the folders those steps published belong to a discarded timeline
    and must neither be loaded nor count as the newest when pruning.
    """
    for path in Path(weights_dir).glob("v[0-9]*"):
        if path.is_dir() and int(path.name[1:7]) > version:
            shutil.rmtree(path, ignore_errors=True)


def _prune(weights_dir: Path, keep: int) -> None:
    versions = sorted(p for p in weights_dir.glob("v[0-9]*") if not p.name.endswith(".tmp"))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def private_folder(root: Path, prefix: str) -> Path:
    """``root/<prefix><host>-<pid>``: this process's own folder under ``root``. The host keeps processes of
    several machines that share ``root`` apart; the PID says whether the owner still runs
    (:func:`sweep_private_folders`)."""
    return Path(root) / f"{prefix}{socket.gethostname()}-{os.getpid()}"


def sweep_private_folders(root: Path, prefix: str) -> None:
    """Remove the :func:`private_folder` s under ``root`` of this host's processes that no longer run (killed
    before they could remove their own). Other hosts' folders, and running processes', are left alone."""
    mine = f"{prefix}{socket.gethostname()}-"
    for path in Path(root).glob(f"{glob.escape(mine)}*"):
        pid = path.name[len(mine) :]
        if pid.isdigit() and int(pid) != os.getpid() and not process_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine. Signal 0 only asks: another user's process refuses it,
    and runs; a zombie (ended, not yet reaped) does not run."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc here, or the process ended just now
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_state_dict(folder: Path, version: int) -> dict[str, torch.Tensor]:
    """Read version ``version`` from its folder (a model's, or a PEFT adapter's) fully into CPU memory."""
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors"
    if not path.exists() and (Path(folder) / ADAPTER_FILE).exists():
        path = Path(folder) / ADAPTER_FILE
    if not path.exists():
        raise FileNotFoundError(f"weights v{version}: {path} is missing (pruned or never written)")
    return load_file(path)


def check_shapes(
    expected: Mapping[str, Sequence[int]],
    got: Mapping[str, Sequence[int]],
    version: int,
    optional: Collection[str] = (),
) -> None:
    """Raise ``ValueError`` unless ``got`` has every name of ``expected``, with the same shapes.

    ``optional`` names may come on top (a tied ``lm_head.weight``). Called
    before anything is loaded, so a mismatch changes nothing.
    """
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected and k not in optional]
    wrong = [
        f"{k} {tuple(got[k])}!={tuple(expected[k])}"
        for k in got
        if k in expected and tuple(got[k]) != tuple(expected[k])
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"weights v{version} do not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
        )


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], version: int) -> None:
    """Copy ``state`` into ``model``, all or nothing.

    Every name and shape is checked before the first parameter changes, so a
    mismatched checkpoint leaves the model exactly as it was.
    """
    import torch

    current = model.state_dict()
    tied = [k for k in current if _is_tied(model, k)]
    check_shapes(
        {k: t.shape for k, t in current.items() if k not in tied},
        {k: t.shape for k, t in state.items()},
        version,
        optional=tied,
    )
    with torch.no_grad():
        for name, tensor in state.items():
            current[name].copy_(tensor)


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))
