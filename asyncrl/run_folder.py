"""A run folder: who holds it, whether a run may start fresh or resume in it, and how its processes ended.

Both ends of a run read it: the launchers (``asyncrl run``, Ray) and the learner started by hand, which holds its
folder and checks its checkpoint the same way."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from pathlib import Path
from typing import Any


def exit_description(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    hint = " (also how the kernel's out-of-memory killer ends a process: see dmesg)" if -code == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def take_folder(out: Path, resume: bool) -> None:
    """A run that resumes needs the folder's checkpoint; a fresh one refuses a folder with checkpoints, and
    clears an earlier run's records from it."""
    if resume:
        if problem := cannot_resume(out):
            raise FileNotFoundError(problem)
        (out / "summary.json").unlink(missing_ok=True)  # the run it continues ended there: this one has not
        return
    if problem := cannot_start_fresh(out):
        raise ValueError(problem)
    # A fresh run in an old folder starts fresh records: nothing of the earlier run's passes for this one's.
    records = ("metrics.jsonl", "summary.json", "consumed.jsonl", "dropped.jsonl", "eval.jsonl", "rollouts.jsonl")
    for name in (*records, "trace.json"):
        (out / name).unlink(missing_ok=True)
    for name in ("tensorboard", "eval", "trace"):
        shutil.rmtree(out / name, ignore_errors=True)


def cannot_start_fresh(run_dir: str | Path) -> str | None:
    """Why a fresh run cannot start in ``run_dir`` (it holds an earlier run's checkpoints, which the new run would
    neither continue nor keep, and whose newest it could not write over), or None."""
    latest = Path(run_dir) / "checkpoints" / "LATEST"
    if not latest.exists():
        return None
    return (
        f"{run_dir} holds the checkpoints of an earlier run (newest: {latest.read_text().strip()}): --resume "
        f"continues it; to start over, remove {Path(run_dir) / 'checkpoints'} or give another --run-dir"
    )


def cannot_resume(run_dir: str | Path) -> str | None:
    """Why ``--resume`` cannot continue the run in ``run_dir`` (it has no checkpoint), or None."""
    if (Path(run_dir) / "checkpoints" / "LATEST").exists():
        return None
    return (
        f"--resume: {run_dir} has no checkpoint (no checkpoints/LATEST); a run writes them every "
        "learner.checkpoint_every_steps steps (0, the default: none)"
    )


_claimed: dict[Path, Any] = {}


def claim(folder: Path, kind: str = "run", hint: str = "give this one its own --run-dir", user: str = "") -> None:
    """Hold ``folder`` for this process's runs, its sweep, or a learner's weights (a lock file, released when the
    process ends): a second one in the same folder would write into the first one's records. ``user``: what
    holds a ``kind`` folder (``kind`` itself by default: a run holds a run folder)."""
    folder = folder.resolve()
    if folder in _claimed:
        return
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / f".asyncrl-{kind}.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        raise ValueError(
            f"{kind} folder {folder} is in use by another {user or kind}{f' ({holder})' if holder else ''}: {hint}"
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    _claimed[folder] = handle


def release(run_dir: Path) -> None:
    handle = _claimed.pop(run_dir.resolve(), None)
    if handle is not None:
        handle.close()


def stopped_early(out: Path) -> str | None:
    """Why a learner that exited 0 did not finish the run in ``out`` (it wrote no summary: one stopped on its own,
    by a SIGTERM, checkpoints and exits 0 without), or None. A run starts without ``summary.json``
    (:func:`prepare`), so one there is this run's."""
    if (out / "summary.json").exists():
        return None
    return (
        "the learner stopped before its last step (a SIGTERM of its own?); it checkpoints as it stops: "
        "--resume continues the run"
    )
