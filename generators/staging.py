"""Private copies of the weight folders a vLLM engine loads, out of reach of the learner's pruning.

The learner deletes old versions as it publishes new ones, and vLLM's
in-place reload reads a folder's files while it loads: a version pruned
mid-load would leave a half-loaded model. The engine therefore loads a
private copy (hard links next to the learner's folder, or copies into a
stage folder across file systems), and keeps the one serving now to go
back to should a later load fail. A generator killed without closing its
backend leaves its copies behind; the next one on the host removes them.
Before any of that, a folder's tensor names and shapes are read from its
safetensors headers (:func:`checkpoint_spec`), to check a version against
the model the engine started with.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

from asyncrl.weights import folders

# Private copies of loaded versions (:func:`asyncrl.weights.folders.private_folder`):
# ``<weights_dir>/.vllm-stage-<host>-<pid>/`` (hard links), or ``<stage_dir>/asyncrl-vllm-<host>-<pid>/``
# (copies) across file systems.
_STAGE_PREFIXES = (".vllm-stage-", "asyncrl-vllm-")


def sweep_stages(root: Path) -> None:
    """Remove the private copies under ``root`` of generators of this host that no longer run: one killed
    without closing its backend (SIGKILL, the OOM killer, a Ray kill) left a whole model behind, which no
    pruning of the learner's ever touches (in RAM, where the weights live on /dev/shm)."""
    for prefix in _STAGE_PREFIXES:
        folders.sweep_private_folders(root, prefix)


_ATTEMPTS = itertools.count()  # numbers each staging, so that a retry never shares a folder with the one before


def stage(folder: Path, version: int, stage_dir: str | None, keep: Path | None = None) -> Path:
    """Hard-link (or copy, across file systems, into ``stage_dir``) the folder's files where pruning cannot reach.

    Copies that generators killed earlier left next to it are removed first, and so are this process's
    earlier attempts at ``version`` other than ``keep`` (the copy serving now): an attempt that ran out of
    time may still be copying, and it fails once its folder is gone, where it used to write on into the
    folder a retry handed to the engine. With ``keep`` (one engine's weights, of which only the serving copy
    lives) every other attempt goes, an abandoned one at an earlier version too: the next announcement is
    usually a newer version, and such a copy would stay a whole model until the process ends.
    """
    for root, prefix, place in (
        (folder.parent, ".vllm-stage-", os.link),
        (Path(stage_dir or tempfile.gettempdir()), "asyncrl-vllm-", shutil.copy2),
    ):
        sweep_stages(root)
        try:
            private = folders.private_folder(root, prefix)
            for earlier in private.glob("v*" if keep is not None else f"v{version:06d}.*"):
                if earlier != keep:
                    shutil.rmtree(earlier, ignore_errors=True)
            target = private / f"v{version:06d}.{next(_ATTEMPTS)}"
            target.mkdir(parents=True)
            for path in folder.iterdir():
                if path.is_file():
                    place(path, target / path.name)
            return target
        except OSError:
            if place is shutil.copy2:
                raise
    raise AssertionError("unreachable")


def checkpoint_spec(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of every ``*.safetensors`` file in ``folder``, from the headers.

    ``safe_open`` reads only the header and rejects a file shorter than its
    header says, so a truncated file fails here instead of half-way through a load.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    spec: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                spec.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise ValueError(f"{path}: unreadable or truncated safetensors file: {exc}") from exc
    return spec


def model_spec(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of an HF folder: from its safetensors headers, else from its config.

    A folder with a config alone (random-init benchmarks, ``load_format="dummy"``)
    is built on the meta device, which allocates nothing.
    """
    if any(Path(folder).glob("*.safetensors")):
        return checkpoint_spec(folder)
    from asyncrl.weights.adapters import without_weights

    return {name: tuple(p.shape) for name, p in without_weights(folder).named_parameters()}
