"""What a run checks and settles before any process starts.

Its config and overrides, the model, ports, task, threads and secrets."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from asyncrl.config import RunConfig, check_secrets, load_config
from asyncrl.envs import check_environment
from asyncrl.extras import require, resolve_backend
from asyncrl.launch import mps
from asyncrl.run_folder import claim, release, take_folder
from asyncrl.tasks import check_task
from asyncrl.weights.adapters import check_lora
from asyncrl.wire.ports import free_port, in_use, is_loopback, split_address


def thread_overrides(config: RunConfig, cores: int | None = None) -> list[str]:
    """torch threads for the processes this machine runs, where the config leaves them unset.

    Every learner rank and generator gets an equal share of the cores (at
    least one): more threads than cores makes every process slower.
    """
    cores = cores or len(os.sched_getaffinity(0))
    share = max(1, cores // (config.learner.ranks + config.generator.replicas))
    return [
        f"--{section}.torch_threads={share}"
        for section in ("learner", "generator")
        if getattr(config, section).torch_threads is None
    ]


def prepare(
    config_path: str,
    overrides: list[str],
    run_dir: str | None,
    free_ports: bool,
    local: bool = True,
    resume: bool = False,
) -> tuple[RunConfig, list[str]]:
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
        overrides += [
            f"--buffer.address=tcp://127.0.0.1:{free_port()}",
            f"--coordinator.address=tcp://127.0.0.1:{free_port()}",
        ]
    config = load_config(config_path, overrides)
    if not config.coordinator.run_id:  # every process of this launch: a generator joins this run's learner only
        overrides += [f"--coordinator.run_id={secrets.token_hex(6)}"]
        config = load_config(config_path, overrides)
    if config.generator.backend == "vllm":
        require("vllm", "generator.backend: vllm")  # one clear line, before any process starts
    if config.buffer.type == "inproc":
        raise ValueError(
            "buffer.type: inproc passes rollouts within one process (tests); the learner and "
            "generators run as processes of their own: use zmq (the default) or redis"
        )
    model_dir = Path(config.model.path).expanduser()
    check_task(config.task, str(model_dir) if local and model_dir.is_dir() else None)
    check_environment(config.task)
    check_lora(  # the launcher imports no role package: a user's project may have its own generators/
        config.learner.lora,
        resolve_backend(config.generator.backend),
        str(model_dir) if local and model_dir.is_dir() else None,
    )
    mps.check(config.mps, local)
    if config.push.address and config.push.generators != config.generator.replicas:
        raise ValueError(
            f"push.generators ({config.push.generators}) must equal generator.replicas "
            f"({config.generator.replicas}): every push waits for every generator"
        )
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
        take_folder(out, resume)
    except BaseException:
        release(out)  # refused: the folder stays free for a corrected run
        raise
    return config, overrides


def check_model_path(path: str) -> None:
    """``model.path`` must be an HF model folder here, or a Hugging Face Hub id that is in the local cache or
    can be fetched now: otherwise every process would fail on its own, with a download traceback."""
    folder = Path(path).expanduser()
    if folder.is_file():
        raise FileNotFoundError(
            f"model.path: {path} is a file; give the HF model folder that holds it"
            + (f" ({folder.parent})" if folder.name == "config.json" else "")
        )
    if folder.exists():
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"model.path: {path} has no config.json (an HF model folder has one)")
        return
    from asyncrl.launch.models import SOURCES

    known = (
        f"; write it with `asyncrl model import {folder.name} {path}`"
        if folder.name in SOURCES
        else "; `asyncrl model list` shows the models `asyncrl model import` can write"
    )
    parent = folder.parent
    if folder.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1 or parent.is_dir():
        here = sorted(p.name for p in parent.iterdir() if p.is_dir())[:8] if parent.is_dir() else []
        raise FileNotFoundError(
            f"model.path: {path} does not exist" + (f" ({parent} holds: {', '.join(here)})" if here else "") + known
        )
    why = _hub_problem(path)  # org/name: a folder not written yet, or a Hub id
    if why:
        raise FileNotFoundError(
            f"model.path: {path} is not a folder here, nor a Hugging Face Hub model this "
            f"machine can fetch ({why}){known}"
        )


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
        ports += [
            ("prometheus.generator_port", f"{prometheus.host}:{prometheus.generator_port + i}")
            for i in range(config.generator.replicas)
        ]
    return ports


def check_ports(config: RunConfig, free_ports: bool) -> None:
    """Refuse to start over a port something already listens on (most often another run on this machine):
    a generator started anyway would join that run under its own id and take its work."""
    for key, address in listened_on(config):
        split = split_address(address)
        if split is not None and in_use(*split):
            hint = "" if free_ports else "; --free-ports picks free ones for this run"
            raise ValueError(f"{key}: {address} is in use on this machine (another run?){hint}")


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
