"""The /metrics endpoint: values from a snapshot, loopback by default, basic auth beyond it."""

import base64
import urllib.error
import urllib.request

import pytest

from asyncrl.prometheus import Metric, MetricsEndpoint
from conftest import free_port


def scrape(port: int, password: str | None = None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if password is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"asyncrl:{password}".encode()).decode())
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.read().decode()


def test_each_scrape_reads_the_latest_snapshot():
    snapshot = {"step": 3}

    def read():
        return [Metric("learner_step", "steps", snapshot["step"]),
                Metric("samples_dropped", "drops", {"stale": 2, "orphaned": 1}, counter=True)]

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
    finally:
        endpoint.close()
