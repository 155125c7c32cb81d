"""Whether several runs can share one generator process and its engine (``asyncrl-generator A.yaml B.yaml``,
``asyncrl run A.yaml B.yaml``): each trains an adapter on one base, with its own name, folder and addresses."""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.config.run import RunConfig
from asyncrl.config.sections import ConfigError
from asyncrl.extras import resolve_backend


def check_shared_engine(configs: Sequence[RunConfig], paths: Sequence[str]) -> None:
    """Before anything starts: the runs of ``paths`` can share one engine (:func:`check_one_engine`), each
    with its own name, run folder, coordinator and buffer; a :class:`ConfigError` naming the file and the key
    otherwise."""
    check_one_engine(configs, paths)
    seen: dict[tuple[str, object], str] = {}
    for config, path in zip(configs, paths):
        for key, value in (
            ("name", config.name),
            ("run_dir", config.run_dir),
            ("coordinator.address", config.coordinator.address),
            ("buffer.address" if config.buffer.type == "zmq" else "buffer.stream", _buffer_of(config)),
            ("prometheus.generator_port", config.prometheus.generator_port),
        ):
            if value is None:  # no endpoint: nothing to share
                continue
            if (key, value) in seen:
                raise ConfigError(f"{path}: {key}: {value!r} is {seen[key, value]}'s too; each run needs its own")
            seen[key, value] = path


def check_one_engine(configs: Sequence[RunConfig], paths: Sequence[str]) -> None:
    """The runs of ``paths`` train adapters on one base, with one engine's settings."""
    first, first_path = configs[0], paths[0]
    for config, path in zip(configs, paths):
        if not config.learner.lora.enabled:
            raise ConfigError(
                f"{path}: learner.lora.rank: runs that share a generator each train an adapter on one base "
                "(rank 0 trains the whole model)"
            )
        if resolve_backend(config.generator.backend) != "vllm":
            raise ConfigError(f"{path}: generator.backend: runs share a vLLM engine (got {config.generator.backend!r})")
        for key, mine, theirs in (
            ("model.path", config.model.path, first.model.path),
            ("model.dtype", config.model.dtype, first.model.dtype),
            ("generator.devices", config.generator.devices, first.generator.devices),
            ("generator.vllm", config.generator.vllm, first.generator.vllm),
            ("mps", config.mps, first.mps),  # one engine, one GPU: one answer to whether MPS runs it
        ):
            if mine != theirs:
                raise ConfigError(
                    f"{path}: {key} differs from {first_path}'s: runs that share a generator share its engine"
                )


def _buffer_of(config: RunConfig) -> str:
    buffer = config.buffer
    return buffer.address if buffer.type == "zmq" else f"{buffer.redis_url} {buffer.stream}"
