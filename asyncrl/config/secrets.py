"""Secrets the config names by file (the push rendezvous key, the Prometheus password), never by value.

Read at start (:func:`check_secrets`), so a missing or empty file stops a
process before its first push or scrape rather than during the run.
"""

from __future__ import annotations

from asyncrl.config.deployment import PushConfig
from asyncrl.config.run import RunConfig
from asyncrl.config.sections import ConfigError


def read_secret(push: PushConfig) -> str:
    """The shared secret in ``push.secret_file``; a push without one is refused (the store it rendezvouses
    on listens on every interface, whatever host ``push.address`` names)."""
    if not push.secret_file:
        raise ConfigError(
            "push.secret_file is required with push.address: the rendezvous store listens on every "
            "interface (`asyncrl run` writes one into the run folder; started by hand, give every "
            "process the same file)"
        )
    return read_secret_file(push.secret_file, "push.secret_file")


def read_secret_file(path: str, field: str) -> str:
    """The secret in the file ``field`` names; an unreadable or empty one is a :class:`ConfigError`."""
    try:
        secret = open(path).read().strip()
    except OSError as error:
        raise ConfigError(f"{field}: cannot read {path}: {error}") from error
    if not secret:
        raise ConfigError(f"{field}: {path} is empty; an empty secret keys nothing")
    return secret


def check_secrets(config: RunConfig, learner: bool = True, generator: bool = True) -> None:
    """The secrets the learner's and/or a generator's side will key with, read at start rather than at the first
    push or scrape."""
    if config.push.address:
        read_secret(config.push)
    prometheus = config.prometheus
    ports = [prometheus.learner_port if learner else None, prometheus.generator_port if generator else None]
    if any(port is not None for port in ports) and not prometheus.secret_file:
        from asyncrl.wire.ports import is_loopback_host

        if not is_loopback_host(prometheus.host):  # before the model loads, not once it has
            raise ConfigError(
                f"prometheus.host {prometheus.host} (beyond loopback) requires prometheus.secret_file, a password "
                "scrapers send with HTTP basic auth"
            )
    if prometheus.secret_file and any(port is not None for port in ports):
        read_secret_file(prometheus.secret_file, "prometheus.secret_file")
