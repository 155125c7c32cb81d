"""Prometheus ``/metrics`` for the learner and each generator, off unless a port is configured.

Each scrape reads a snapshot that the process hands over (the learner's
:class:`~asyncrl.wire.protocol.Status` and last step record, a generator's
counters); nothing iterates live state owned by another thread. Metrics are
served by prometheus-client's WSGI app from a daemon thread, so a slow or
broken scraper never blocks training or generation.

Like every other endpoint, one bound beyond loopback requires a shared
secret: scrapers then authenticate with HTTP basic auth (user ``asyncrl``,
the password read from ``prometheus.secret_file``), which Prometheus supports
in its scrape config (``basic_auth``).
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Family
from prometheus_client.registry import Collector

from asyncrl.config import read_secret_file
from asyncrl.wire.ports import is_loopback_host

PREFIX = "asyncrl_"


@dataclass(frozen=True)
class Metric:
    """One value to expose; a dict value becomes one sample per ``label`` value."""

    name: str
    help: str
    value: float | dict[str, float]
    counter: bool = False
    label: str = "reason"


class SnapshotCollector(Collector):
    """Turns whatever ``read()`` returns at scrape time into metric families."""

    def __init__(self, read: Callable[[], Iterable[Metric]], labels: dict[str, str]) -> None:
        self._read = read
        self._labels = labels

    def collect(self) -> Iterator[Family]:
        names, values = list(self._labels), list(self._labels.values())
        for metric in self._read():
            kind = CounterMetricFamily if metric.counter else GaugeMetricFamily
            if isinstance(metric.value, dict):
                family = kind(PREFIX + metric.name, metric.help, labels=[*names, metric.label])
                for key, value in sorted(metric.value.items()):
                    family.add_metric([*values, key], float(value))
            else:
                family = kind(PREFIX + metric.name, metric.help, labels=names)
                family.add_metric(values, float(metric.value))
            yield family


MAX_CONNECTIONS = 16  # scrapes at once; a scraper needs one


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds a client may take to send its request: a silent one does not hold a thread for ever

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (scrapes are not news)
        pass


def _is_ipv6(host: str) -> bool:
    """An IPv6 literal (``::1``, ``::``): names such as localhost keep the IPv4 server they always had."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per connection, at most ``MAX_CONNECTIONS`` at once; more are closed unanswered."""

    daemon_threads = True
    request_queue_size = 64  # connections waiting to be accepted

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that went silent or away is not news either
            super().handle_error(request, client_address)


def _with_basic_auth(app, password: str):
    expected = ("Basic " + base64.b64encode(f"asyncrl:{password}".encode()).decode()).encode()

    def guarded(environ, start_response):
        # A WSGI header is a latin-1 string: compared as bytes, a non-ASCII one is a wrong password, not a 500.
        if not hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode("latin-1"), expected):
            start_response(
                "401 Unauthorized", [("WWW-Authenticate", 'Basic realm="asyncrl"'), ("Content-Type", "text/plain")]
            )
            return [b"unauthorized\n"]
        return app(environ, start_response)

    return guarded


class MetricsEndpoint:
    """A running ``/metrics`` server; :meth:`close` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        read: Callable[[], Iterable[Metric]],
        labels: dict[str, str],
        secret_file: str | None = None,
        field: str = "prometheus.learner_port",
    ) -> None:
        if not is_loopback_host(host) and not secret_file:
            raise ValueError(
                f"{field}: serving metrics on prometheus.host {host} (beyond loopback) requires "
                "prometheus.secret_file, a password scrapers send with HTTP basic auth"
            )
        registry = CollectorRegistry(auto_describe=True)
        registry.register(SnapshotCollector(read, labels))
        app = make_wsgi_app(registry)
        if secret_file:
            app = _with_basic_auth(app, read_secret_file(secret_file, "prometheus.secret_file"))
        server = _ThreadingServer
        if _is_ipv6(host):  # ::1, ::
            server = type("_ThreadingServer6", (_ThreadingServer,), {"address_family": socket.AF_INET6})
        self._server = make_server(host, port, app, server, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
