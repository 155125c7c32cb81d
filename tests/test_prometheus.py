"""The /metrics endpoint: values from a snapshot, loopback by default, basic auth beyond it."""

import base64
import http.client
import urllib.error
import urllib.request

import pytest
from conftest import ROOT, free_port, wait_for

from asyncrl.config import ConfigError
from asyncrl.observe.prometheus import Metric, MetricsEndpoint


def scrape(port: int, password: str | None = None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if password is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"asyncrl:{password}".encode()).decode())
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.read().decode()


def test_each_scrape_reads_the_latest_snapshot():
    snapshot = {"step": 3}

    def read():
        return [
            Metric("learner_step", "steps", snapshot["step"]),
            Metric("samples_dropped", "drops", {"stale": 2, "orphaned": 1}, counter=True),
        ]

    endpoint = MetricsEndpoint("127.0.0.1", 0, read, {"run": "t"})
    try:
        text = scrape(endpoint.port)
        assert 'asyncrl_learner_step{run="t"} 3.0' in text
        assert 'asyncrl_samples_dropped_total{reason="stale",run="t"} 2.0' in text
        assert 'asyncrl_samples_dropped_total{reason="orphaned",run="t"} 1.0' in text
        snapshot["step"] = 4
        assert 'asyncrl_learner_step{run="t"} 4.0' in scrape(endpoint.port)
    finally:
        endpoint.close()


def test_ipv6_loopback_serves_as_the_config_check_allows_it():
    from asyncrl.observe.prometheus import _is_ipv6

    assert (_is_ipv6("::1"), _is_ipv6("::"), _is_ipv6("localhost"), _is_ipv6("127.0.0.1")) == (True, True, False, False)
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    endpoint = MetricsEndpoint("::1", 0, lambda: [Metric("learner_step", "steps", 7)], {"run": "t"})
    try:
        with urllib.request.urlopen(f"http://[::1]:{endpoint.port}/metrics", timeout=5) as reply:
            assert 'asyncrl_learner_step{run="t"} 7.0' in reply.read().decode()
    finally:
        endpoint.close()


def test_beyond_loopback_a_secret_is_required_and_checked(tmp_path):
    with pytest.raises(ValueError, match="prometheus.learner_port.*secret_file"):
        MetricsEndpoint("0.0.0.0", free_port(), list, {}, None, "prometheus.learner_port")
    secret = tmp_path / "metrics.secret"
    secret.write_text("s3cret\n")
    endpoint = MetricsEndpoint("0.0.0.0", 0, lambda: [Metric("up", "up", 1)], {}, str(secret))
    try:
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(endpoint.port)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(endpoint.port, "wrong")
        assert "asyncrl_up 1.0" in scrape(endpoint.port, "s3cret")
        connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5)
        connection.request("GET", "/metrics", headers={"Authorization": "Basic s3crét"})  # sent as latin-1
        assert connection.getresponse().status == 401  # was a 500 and a traceback in the log
        connection.close()
    finally:
        endpoint.close()
    secret.write_text("\n")
    with pytest.raises(ConfigError, match="prometheus.secret_file: .* is empty"):  # it let `-u asyncrl:` in
        MetricsEndpoint("0.0.0.0", 0, list, {}, str(secret))


def test_silent_connections_neither_hold_a_thread_for_ever_nor_crowd_out_a_scrape(monkeypatch):
    """500 half-sent requests held 500 threads for a minute and more; now at most MAX_CONNECTIONS are served at
    once, each for at most the handler's timeout."""
    import select
    import socket
    import threading

    from asyncrl.observe import prometheus

    def closed(s):  # by the server, unanswered
        if not select.select([s], [], [], 0)[0]:
            return False
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True

    assert 0 < prometheus._QuietHandler.timeout <= 30
    monkeypatch.setattr(prometheus._QuietHandler, "timeout", 2.0)
    endpoint = MetricsEndpoint("127.0.0.1", 0, lambda: [Metric("up", "up", 1)], {})
    threads = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(40)]
    try:
        for s in silent:
            s.sendall(b"GET /metr")
        # Until the handler's timeout: MAX_CONNECTIONS are held, one thread each, and the rest were closed.
        limit = prometheus.MAX_CONNECTIONS
        wait_for(
            lambda: (sum(closed(s) for s in silent), threading.active_count() - threads) == (40 - limit, limit),
            timeout_s=2.0,
        )
        wait_for(lambda: threading.active_count() == threads)  # their time is up
        assert "asyncrl_up 1.0" in scrape(endpoint.port)
    finally:
        for s in silent:
            s.close()
        endpoint.close()


@pytest.mark.parametrize("command, port", [("learners.cli", "learner_port"), ("generators.cli", "generator_port")])
def test_a_process_with_an_empty_metrics_secret_will_not_start(command, port, tmp_path):
    """Read at start, in one line, not once the engine is built and the endpoint opens."""
    import subprocess
    import sys

    secret = tmp_path / "metrics.secret"
    secret.write_text("")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            command,
            "configs/ci-tiny.yaml",
            f"--prometheus.{port}=0",
            "--prometheus.host=0.0.0.0",
            f"--prometheus.secret_file={secret}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"prometheus.secret_file: {secret} is empty" in out.stderr and "Traceback" not in out.stderr


def test_metrics_beyond_loopback_without_a_secret_are_refused_before_anything_starts():
    """Checked with the other secrets at start (the learner would otherwise load its model first), naming the keys."""
    from asyncrl.config import ConfigError, check_secrets, load_config

    config = load_config("configs/ci-tiny.yaml", ["--prometheus.learner_port=0", "--prometheus.host=0.0.0.0"])
    with pytest.raises(
        ConfigError, match=r"prometheus.host 0.0.0.0 \(beyond loopback\) requires prometheus.secret_file"
    ):
        check_secrets(config)
    check_secrets(config, learner=False)  # a generator without a metrics port of its own serves nothing
    check_secrets(load_config("configs/ci-tiny.yaml", ["--prometheus.learner_port=0"]))  # loopback: no secret
