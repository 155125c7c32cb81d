"""``asyncrl run``: start a learner and its generators on this machine and watch them.

Each process is the real entrypoint (``asyncrl-learner``, ``asyncrl-generator``)
started as a subprocess with its own log under ``RUN_DIR/logs``, exactly as a
user would start them on separate machines. The launcher only supervises:
it draws the progress bar from ``metrics.jsonl``, stops every process it
started (by PID) when the learner ends or fails, and prints the summary.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

from asyncrl.config import RunConfig, check_secrets, load_config
from asyncrl.extras import require
from asyncrl.metrics import last_metrics, read_metrics, reward_text, scored
from asyncrl.ports import free_port, in_use, split_address
from asyncrl.tasks import check_task, child_env
from asyncrl.transport import is_loopback


class Launch:
    """The processes of one run and their logs (``resume``: appended to, after the logs of the run it continues,
    which may say why that one ended)."""

    def __init__(self, config_path: str, overrides: list[str], run_dir: Path, resume: bool = False) -> None:
        self.config_path = config_path
        self.overrides = overrides
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, args: list[str], devices: str | None = None) -> None:
        log = open(self.logs / f"{name}.log", "a" if self.resume else "w")
        if self.resume:
            log.write(f"\n===== asyncrl run --resume, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
            log.flush()
        env = child_env(PYTHONUNBUFFERED="1")
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, self.config_path, *self.overrides, *args],  # per-process args win
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_stop_with_launcher(),
        )

    def stop_all(self, grace_s: float = 10.0, learner_grace_s: float = 120.0) -> None:
        """Stop every process still running (by process group); SIGKILL what outlives its grace.

        The learner gets ``learner_grace_s`` (``learner.stop_timeout_s``) to
        finish its step and checkpoint. One that outlives it gets SIGUSR1
        first, which writes every thread's stack to its log, so a run stopped
        in a hung step says where; its descendants are signalled one by one
        too, since torchrun starts each rank in a session of its own, out of
        reach of the group.

        A generator drains on SIGTERM, which is worth it only while the
        learner runs to take what it writes: once the learner has exited,
        the generators get a second SIGTERM (which a draining generator obeys
        at once) and ``grace_s`` to exit, and those found running after the
        learner had already exited are killed straight away.
        """
        learner = self.procs.get("learner")
        learner_gone = learner is None or learner.poll() is not None
        if not learner_gone:
            print(f"asyncrl run: stopping; the learner finishes its step and checkpoints (up to "
                  f"{learner_grace_s:.0f}s, learner.stop_timeout_s)", file=sys.stderr, flush=True)
        for name, proc in self.procs.items():
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL if learner_gone and name != "learner" else signal.SIGTERM)
        if not learner_gone:
            try:
                learner.wait(timeout=learner_grace_s)
            except subprocess.TimeoutExpired:
                pass
            else:
                for name, proc in self.procs.items():
                    if name != "learner" and proc.poll() is None:
                        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=0 if name == "learner" else max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                below: list[int] = []
                if name == "learner":  # its log gets every thread's stack (asyncrl.logs.setup): where it waited
                    below = _descendants(proc.pid)
                    # One process at a time: the ranks share the log, and stacks written at once interleave.
                    for pid in [proc.pid, *below]:
                        _signal_each([pid], signal.SIGUSR1)
                        time.sleep(0.25)
                    time.sleep(0.5)
                _signal_group(proc, signal.SIGKILL)
                _signal_each(below, signal.SIGKILL)
                proc.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])


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


def _stop_with_launcher():
    """For Linux: what a child runs before it starts, so that it gets SIGTERM when the launcher dies, however
    the launcher dies (the out-of-memory killer, a SIGKILL after a sweep's grace): it would train on, orphaned.
    Elsewhere None: the launcher's own handlers (Ctrl-C, SIGTERM) still stop what it started."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    launcher = os.getpid()

    def set_death_signal() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def call_within(command: list[str], timeout_s: float, what: str, grace_s: float = 10.0) -> int:
    """Run ``command`` (one process and whatever it starts) to its end and return its exit code, or stop it
    after ``timeout_s`` (SIGTERM, SIGKILL after ``grace_s``) and return 124, as ``timeout(1)`` does.
    Ctrl-C stops it the same way."""
    proc = subprocess.Popen(command, env=child_env(), start_new_session=True, preexec_fn=_stop_with_launcher())
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{what}: not done after {timeout_s:g}s (--timeout-s): stopped", file=sys.stderr, flush=True)
        return_code = 124
    except KeyboardInterrupt:
        return_code = 130
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)  # and whatever it started that outlived it
    proc.wait(timeout=grace_s)
    return return_code


def interrupt_on_sigterm() -> Any:
    """SIGTERM (``kill``, ``timeout``, a scheduler) stops a run as Ctrl-C does: as a ``KeyboardInterrupt``,
    through the cleanup that stops the processes it started (without it, they would train on, orphaned).

    Returns the handler it replaced (None off the main thread, where signals cannot be handled). The handler
    restores the default first, so a second SIGTERM ends the process at once.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    return signal.signal(signal.SIGTERM, interrupt)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def _signal_each(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first (from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after the name: state, parent pid
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def thread_overrides(config: RunConfig, cores: int | None = None) -> list[str]:
    """torch threads for the processes this machine runs, where the config leaves them unset.

    Every learner rank and generator gets an equal share of the cores (at
    least one): more threads than cores makes every process slower.
    """
    cores = cores or len(os.sched_getaffinity(0))
    share = max(1, cores // (config.learner.ranks + config.generator.replicas))
    return [f"--{section}.torch_threads={share}" for section in ("learner", "generator")
            if getattr(config, section).torch_threads is None]


def prepare(config_path: str, overrides: list[str], run_dir: str | None, free_ports: bool,
            local: bool = True, resume: bool = False) -> tuple[RunConfig, list[str]]:
    """The run's config and the overrides every process gets: run dir, free ports, and for a ``local`` run
    (every process on this machine) torch threads that share its cores out.

    Checks what would otherwise fail only once processes run (for a local
    run, that no other process listens on its ports) and holds the run
    folder. A run that ``resume``s needs a checkpoint there, and keeps the
    records (the learner cuts them back to its checkpoint); a fresh run
    clears an earlier run's records, and refuses a folder with checkpoints,
    which it would neither continue nor keep.
    """
    overrides = list(overrides)
    if run_dir:
        overrides += [f"--run_dir={run_dir}"]
    if free_ports:
        overrides += [f"--buffer.address=tcp://127.0.0.1:{free_port()}",
                      f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]
    config = load_config(config_path, overrides)
    if config.generator.backend == "vllm":
        require("vllm", "generator.backend: vllm")  # one clear line, before any process starts
    if config.buffer.type == "inproc":
        raise ValueError("buffer.type: inproc passes rollouts within one process (tests); the learner and "
                         "generators run as processes of their own: use zmq (the default) or redis")
    model_dir = Path(config.model.path).expanduser()
    check_task(config.task, str(model_dir) if local and model_dir.is_dir() else None)
    if config.push.address and config.push.generators != config.generator.replicas:
        raise ValueError(f"push.generators ({config.push.generators}) must equal generator.replicas "
                         f"({config.generator.replicas}): every push waits for every generator")
    if free_ports and config.push.address:
        overrides += [f"--push.address=127.0.0.1:{free_port()}"]
    if local:  # every process runs here, and reads this machine's files and ports
        overrides += thread_overrides(config)
        check_model_path(config.model.path)
        check_ports(config, free_ports)
    out = Path(config.run_dir)
    claim(out)
    try:
        # Only now: a secret written for a run refused here would replace the one of the run holding the folder.
        config, overrides = run_config(config_path, overrides)
        _take_folder(out, resume)
    except BaseException:
        release(out)  # refused: the folder stays free for a corrected run
        raise
    return config, overrides


def _take_folder(out: Path, resume: bool) -> None:
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
    for name in ("metrics.jsonl", "summary.json", "consumed.jsonl", "dropped.jsonl", "eval.jsonl", "trace.json"):
        (out / name).unlink(missing_ok=True)
    for name in ("tensorboard", "eval", "trace"):
        shutil.rmtree(out / name, ignore_errors=True)


def cannot_start_fresh(run_dir: str | Path) -> str | None:
    """Why a fresh run cannot start in ``run_dir`` (it holds an earlier run's checkpoints, which the new run would
    neither continue nor keep, and whose newest it could not write over), or None."""
    latest = Path(run_dir) / "checkpoints" / "LATEST"
    if not latest.exists():
        return None
    return (f"{run_dir} holds the checkpoints of an earlier run (newest: {latest.read_text().strip()}): --resume "
            f"continues it; to start over, remove {Path(run_dir) / 'checkpoints'} or give another --run-dir")


def cannot_resume(run_dir: str | Path) -> str | None:
    """Why ``--resume`` cannot continue the run in ``run_dir`` (it has no checkpoint), or None."""
    if (Path(run_dir) / "checkpoints" / "LATEST").exists():
        return None
    return (f"--resume: {run_dir} has no checkpoint (no checkpoints/LATEST); a run writes them every "
            "learner.checkpoint_every_steps steps (0, the default: none)")


def check_model_path(path: str) -> None:
    """``model.path`` must be an HF model folder here, or a Hugging Face Hub id that is in the local cache or
    can be fetched now: otherwise every process would fail on its own, with a download traceback."""
    folder = Path(path).expanduser()
    if folder.is_file():
        raise FileNotFoundError(f"model.path: {path} is a file; give the HF model folder that holds it"
                                + (f" ({folder.parent})" if folder.name == "config.json" else ""))
    if folder.exists():
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"model.path: {path} has no config.json (an HF model folder has one)")
        return
    from asyncrl.models import SOURCES

    known = f"; write it with `asyncrl model import {folder.name} {path}`" if folder.name in SOURCES else \
        "; `asyncrl model list` shows the models `asyncrl model import` can write"
    parent = folder.parent
    if folder.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1 or parent.is_dir():
        here = sorted(p.name for p in parent.iterdir() if p.is_dir())[:8] if parent.is_dir() else []
        raise FileNotFoundError(f"model.path: {path} does not exist"
                                + (f" ({parent} holds: {', '.join(here)})" if here else "") + known)
    why = _hub_problem(path)  # org/name: a folder not written yet, or a Hub id
    if why:
        raise FileNotFoundError(f"model.path: {path} is not a folder here, nor a Hugging Face Hub model this "
                                f"machine can fetch ({why}){known}")


def _hub_problem(repo_id: str) -> str | None:
    """None if the Hub model ``repo_id`` is in the local cache or its config can be fetched now; else why not."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return None
    except ValueError as exc:  # not a valid repo id
        return str(exc).splitlines()[0][:200]
    if constants.HF_HUB_OFFLINE:
        return "not in the local cache, and HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:  # no network: the Hub client would retry for half a minute to say the same
        return f"not in the local cache, and {host} cannot be reached"
    try:
        hf_hub_download(repo_id, "config.json")
    except Exception as exc:  # noqa: BLE001  (no such repo, gated, offline: each says why)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no detail'}"
    return None


def listened_on(config: RunConfig) -> list[tuple[str, str]]:
    """(key, address) of every port a run's processes will listen on at this machine."""
    ports = [("coordinator.address", config.coordinator.address)]
    if config.buffer.type == "zmq":
        ports.append(("buffer.address", config.buffer.address))
    if config.coordinator.weights_address:
        ports.append(("coordinator.weights_address", config.coordinator.weights_address))
    if config.push.address:
        ports.append(("push.address", config.push.address))
    prometheus = config.prometheus
    if prometheus.learner_port:
        ports.append(("prometheus.learner_port", f"{prometheus.host}:{prometheus.learner_port}"))
    if prometheus.generator_port:
        ports += [("prometheus.generator_port", f"{prometheus.host}:{prometheus.generator_port + i}")
                  for i in range(config.generator.replicas)]
    return ports


def check_ports(config: RunConfig, free_ports: bool) -> None:
    """Refuse to start over a port something already listens on (most often another run on this machine):
    a generator started anyway would join that run under its own id and take its work."""
    for key, address in listened_on(config):
        split = split_address(address)
        if split is not None and in_use(*split):
            hint = "" if free_ports else "; --free-ports picks free ones for this run"
            raise ValueError(f"{key}: {address} is in use on this machine (another run?){hint}")


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
        raise ValueError(f"{kind} folder {folder} is in use by another {user or kind}"
                         f"{f' ({holder})' if holder else ''}: {hint}") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    _claimed[folder] = handle


def release(run_dir: Path) -> None:
    handle = _claimed.pop(run_dir.resolve(), None)
    if handle is not None:
        handle.close()


def run_config(config_path: str, overrides: list[str]) -> tuple[RunConfig, list[str]]:
    """The config as every process of a run loads it, and the overrides that say so.

    The push rendezvous listens on every interface whatever its address, so
    it is never left open. For a loopback ``push.address`` without
    ``push.secret_file`` the run makes its own secret, in
    ``RUN_DIR/push.secret``, readable by this user only, and points every
    process at it; a generator restarted by hand joins with the same file. A
    push beyond loopback spans machines, which need the file too: its
    ``push.secret_file`` is the user's to give, and is read here, before any
    process starts.
    """
    config = load_config(config_path, overrides)
    push = config.push
    if push.address and not push.secret_file and is_loopback(f"tcp://{push.address}"):
        overrides = overrides + [f"--push.secret_file={new_secret(Path(config.run_dir))}"]
        config = load_config(config_path, overrides)
    check_secrets(config)
    return config, overrides


def new_secret(run_dir: Path) -> Path:
    """A fresh ``run_dir/push.secret`` that only its owner can read."""
    path = run_dir.resolve() / "push.secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # created anew below, so that only its owner can ever read it
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")
    return path


def generator_args(config: RunConfig, i: int) -> list[str]:
    """Command-line arguments of generator ``i`` of a run: its id, push rank and metrics port."""
    return ["--generator-id", f"gen-{i}", *config.replica_overrides(i)]


def run(config_path: str, overrides: list[str], run_dir: str | None, free_ports: bool, timeout_s: float,
        quiet: bool = False, resume: bool = False) -> dict[str, Any]:
    """Run one training job to completion (``resume``: from the run folder's newest checkpoint); returns its
    summary (raises on failure)."""
    config, overrides = prepare(config_path, overrides, run_dir, free_ports, resume=resume)
    out = Path(config.run_dir)
    launch = Launch(config_path, overrides, out, resume)
    launch.start("learner", "learners.cli", ["--resume"] if resume else [], config.learner.devices)
    gpus = config.generator.devices.split(",") if config.generator.devices else None
    for i in range(config.generator.replicas):
        launch.start(f"generator-{i}", "generators.cli", generator_args(config, i),
                     gpus[i % len(gpus)] if gpus else None)
    started = time.monotonic()
    try:
        _supervise(config, launch, out, started, timeout_s, quiet)
        if launch.procs["learner"].returncode != 0:
            raise RuntimeError(f"the learner failed ({exit_description(launch.procs['learner'].returncode)}); "
                               "last lines of its log:\n" + launch.tail("learner"))
        if why := stopped_early(out):
            raise RuntimeError(why)
        return summarize(config, out, started)
    finally:
        release(out)  # last: the folder is this run's until its summary is written


def stopped_early(out: Path) -> str | None:
    """Why a learner that exited 0 did not finish the run in ``out`` (it wrote no summary: one stopped on its own,
    by a SIGTERM, checkpoints and exits 0 without), or None. A run starts without ``summary.json``
    (:func:`prepare`), so one there is this run's."""
    if (out / "summary.json").exists():
        return None
    return ("the learner stopped before its last step (a SIGTERM of its own?); it checkpoints as it stops: "
            "--resume continues the run")


def _supervise(config: RunConfig, launch: Launch, out: Path, started: float, timeout_s: float, quiet: bool) -> None:
    """Show the run's progress until the learner exits; stop every process on the way out, however it ends."""
    try:
        with Progress(config, out, started, timeout_s, quiet) as ticks:
            for _ in ticks:
                if launch.procs["learner"].poll() is not None:
                    break
                dead = [n for n, p in launch.procs.items() if n != "learner" and p.poll() not in (None, 0)]
                if dead and len(dead) == config.generator.replicas:
                    raise RuntimeError(f"every generator exited with an error ({dead[0]} "
                                       f"{exit_description(launch.procs[dead[0]].returncode)}); last lines of "
                                       f"{dead[0]}:\n" + launch.tail(dead[0]))
    finally:
        launch.stop_all(learner_grace_s=config.learner.stop_timeout_s)
        merge_trace(config, out)


class Progress:
    """The clock and progress bar of a run's supervision loop (``asyncrl run``, with or without Ray).

    Iterating ticks every ``every_s``, first redrawing the bar from the
    run's ``metrics.jsonl``, and raises ``TimeoutError`` once ``timeout_s``
    have passed since ``started``; leaving the ``with`` block draws the
    last step and closes the bar.
    """

    def __init__(self, config: RunConfig, out: Path, started: float, timeout_s: float, quiet: bool,
                 every_s: float = 0.5) -> None:
        self.out, self.started, self.timeout_s, self.every_s = out, started, timeout_s, every_s
        self.bar = tqdm(total=config.learner.total_steps, desc=config.name, dynamic_ncols=True,
                        disable=quiet or None)

    def __iter__(self) -> Iterator[None]:
        while True:
            if time.monotonic() - self.started > self.timeout_s:
                raise TimeoutError(f"run did not finish within {self.timeout_s:.0f}s (--timeout-s)")
            update_bar(self.bar, last_metrics(self.out))
            yield
            time.sleep(self.every_s)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        update_bar(self.bar, last_metrics(self.out))
        self.bar.close()


def merge_trace(config: RunConfig, out: Path) -> None:
    """With ``trace: true``, the processes' timelines merged into ``RUN_DIR/trace.json``."""
    if config.trace:
        from asyncrl.trace import merge

        merge(out)


def summarize(config: RunConfig, out: Path, started: float) -> dict[str, Any]:
    """The learner's summary.json with what only the whole run knows; written back and returned."""
    summary = json.loads((out / "summary.json").read_text())
    records = read_metrics(out)
    rewarded = scored(records)
    head, tail = rewarded[: max(1, len(rewarded) // 20)], rewarded[-max(1, len(rewarded) // 20):]
    summary.update(
        run_dir=str(out),
        total_wall_s=time.monotonic() - started,
        reward_start=sum(r["reward"] for r in head) / len(head) if head else None,  # None: every reward failed
        reward_end=sum(r["reward"] for r in tail) / len(tail) if tail else None,
        max_reward=config.task.max_reward,
        staleness_max_observed=max(r["staleness_max"] for r in records),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def update_bar(bar: tqdm, last: dict[str, Any] | None) -> None:
    if last is None:
        return
    bar.set_postfix(reward=reward_text(last["reward"]), version=last["version"],
                    staleness=f"{last['staleness_mean']:.2f}", samples_s=f"{last['samples_per_s']:.0f}",
                    refresh=False)
    bar.update(last["step"] - bar.n)


def compare_sync(config_path: str, overrides: list[str], run_dir: str | None, free_ports: bool,
                 timeout_s: float, quiet: bool = False) -> dict[str, Any]:
    """Run the config as given and again with ``max_staleness=0``; report the speedup."""
    base = Path(run_dir or load_config(config_path, overrides).run_dir)
    runs = {}
    for label, extra in (("async", []), ("sync", ["--staleness.max_staleness=0"])):
        runs[label] = run(config_path, overrides + extra, str(base / label), free_ports, timeout_s, quiet)
    a, s = runs["async"], runs["sync"]
    result = {
        "async": a,
        "sync": s,
        "speedup_samples_per_s": a["achieved_samples_per_s"] / s["achieved_samples_per_s"],
        "wall_ratio_sync_over_async": s["wall_s"] / a["wall_s"],
    }
    (base / "compare.json").write_text(json.dumps(result, indent=2))
    _plot_compare(base, runs)
    return result


def _plot_compare(base: Path, runs: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.metrics import smooth

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, summary in runs.items():
        records = scored(read_metrics(summary["run_dir"]))
        ax.plot([r["wall_s"] for r in records], smooth([r["reward"] for r in records]),
                label=f"{label} (max_staleness={summary['max_staleness']})")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("mean reward (smoothed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(base / "compare.png", dpi=110)
    plt.close(fig)
