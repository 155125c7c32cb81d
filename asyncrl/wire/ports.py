"""Addresses and ports for a run's services: which are loopback-only, and free ports no other process will be
handed."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
_handed_out: set[int] = set()


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is this machine only (a name other than localhost counts as not)."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    """Whether a ``tcp://host:port`` address only accepts local peers."""
    return is_loopback_host(urlparse(address).hostname or "")


def check_address(address: str, field: str) -> None:
    """Reject anything but ``tcp://host:port``, naming the config field."""
    parsed = urlparse(address)
    try:
        port = parsed.port
    except ValueError as exc:  # "Port out of range 0-65535", naming nothing
        raise ValueError(f"{field}: {exc} in {address!r}") from None
    if parsed.scheme != "tcp" or not parsed.hostname or not port:
        raise ValueError(f"{field}: expected tcp://HOST:PORT, got {address!r}")


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (``bind`` to 0, outgoing connections)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535  # the IANA range, which macOS and Windows use


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now, outside the kernel's ephemeral range.

    A port the kernel handed out (``bind`` to 0) can be handed out again, to
    any process's ``bind`` to 0 or outgoing connection (vLLM's, gloo's), before
    its owner binds it, and the push group binds its port only at the first
    push, after the generators have started. A port outside that range is
    taken only by someone who asks for it by number.
    """
    low, high = _ephemeral_ports()
    candidates = range(max(1024, low - 16384), low) if low > 2048 else range(high + 1, 65536)
    for port in random.sample(candidates, min(200, len(candidates))):
        # no address reuse: a port with a connection lingering in TIME_WAIT is passed over as well
        if port not in _handed_out and _binds(host, port, reuse_address=False):
            _handed_out.add(port)
            return port
    raise OSError(
        f"no free port on {host or 'any address'} in {candidates.start}-{candidates.stop - 1} after 200 tries"
    )


def in_use(host: str, port: int) -> bool:
    """Whether a server already listens on ``host:port`` here (as ZeroMQ binds: address reuse on, so a
    connection lingering in TIME_WAIT does not count)."""
    return not _binds("" if host in ("*", "0.0.0.0") else host.strip("[]"), port, reuse_address=True)


def _binds(host: str, port: int, reuse_address: bool) -> bool:
    """Whether a socket can bind ``host:port`` now (it is closed again at once)."""
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def split_address(address: str) -> tuple[str, int] | None:
    """``tcp://HOST:PORT`` or ``HOST:PORT`` as (host, port); None for anything else (ipc://, an inproc name)."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if "://" in rest or not host or not port.isdigit():
        return None
    return host, int(port)
