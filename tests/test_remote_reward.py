"""The remote reward client against fake servers in this process, and the example server as a real process.

Fake servers (stdlib ``ThreadingHTTPServer`` on loopback) script the failures:
down, slow, overloaded, rejecting, replying nonsense, redirecting. The
example server runs ``examples/reward_server.py`` on a tiny random
``LlamaForSequenceClassification`` and is started and ended by its PID.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, FakeClock, free_port, stop_process

from asyncrl.tasks.remote_reward import GroupReward, RemoteReward, RemoteRewardError, is_remote

ITEM = {"prompt": "12=", "label": "12"}


class FakeServer:
    """A loopback JSON server whose replies come from ``respond(request_json, headers) -> (status, payload)``.

    Records every request, the client port it came from, and the most requests it ever had open at once;
    ``wait_until`` waits for a state of those. ``release`` ends any handler waiting on it (the slow server's
    wait). ``keep_alive``: it speaks HTTP/1.1 and keeps connections open (HTTP/1.0 otherwise, one request each).
    """

    def __init__(
        self, respond: Callable[[dict[str, Any], dict[str, str]], tuple[int, Any]], keep_alive: bool = False
    ) -> None:
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.ports: list[int] = []
        self.open = self.max_open = 0
        self.release = threading.Event()
        self.changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.changed:
                    fake.requests.append((body, dict(self.headers)))
                    fake.ports.append(self.client_address[1])
                    fake.open += 1
                    fake.max_open = max(fake.max_open, fake.open)
                    fake.changed.notify_all()
                try:
                    status, payload = respond(body, dict(self.headers))
                finally:
                    with fake.changed:
                        fake.open -= 1
                        fake.changed.notify_all()
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                if status in (301, 302, 307, 308):
                    self.send_header("Location", payload.decode())
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def wait_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        """Whether ``done()`` came true within ``timeout_s`` (checked at every request's start and end)."""
        with self.changed:
            return self.changed.wait_for(done, timeout_s)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def start(
        respond: Callable[[dict[str, Any], dict[str, str]], tuple[int, Any]], keep_alive: bool = False
    ) -> FakeServer:
        servers.append(FakeServer(respond, keep_alive))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def by_length(body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    return 200, {"rewards": [float(len(r)) for r in body["responses"]]}


# The client -------------------------------------------------------------------------------------------------


def test_a_group_goes_in_one_request_of_the_documented_shape(fake_server):
    server = fake_server(by_length)
    reward = RemoteReward(server.url)
    assert isinstance(reward, GroupReward) and is_remote(server.url) and not is_remote("math")
    assert reward.score_group(["1", "12", "123"], ITEM) == [1.0, 2.0, 3.0]
    assert reward("1234", {"prompt": "9="}) == 4.0  # no label: null
    (first, headers), (second, _) = server.requests
    assert first == {"prompts": ["12="] * 3, "responses": ["1", "12", "123"], "labels": ["12"] * 3}
    assert second == {"prompts": ["9="], "responses": ["1234"], "labels": [None]}
    assert headers["Content-Type"] == "application/json" and "Authorization" not in headers
    assert reward.score_group([], ITEM) == [] and len(server.requests) == 2  # nothing to score, nothing sent


def test_a_large_group_is_split_by_max_samples_per_request(fake_server):
    server = fake_server(by_length)
    reward = RemoteReward(server.url, max_samples_per_request=2)
    assert reward.score_group(["1", "22", "333", "4444", "55555"], ITEM) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [len(body["responses"]) for body, _ in server.requests] == [2, 2, 1]


def recording(clock: FakeClock) -> tuple[list[float], Callable[[float], None]]:
    """The waits between attempts, and a ``sleep`` that records each and moves ``clock`` by it."""
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(seconds)

    return waits, sleep


def test_a_server_that_is_down_fails_after_the_retries_with_an_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    clock = FakeClock()
    waits, sleep = recording(clock)
    reward = RemoteReward(url, retries=2, backoff_s=0.05, max_backoff_s=0.1, clock=clock, sleep=sleep)
    with pytest.raises(RemoteRewardError, match=r"no scores after 3 attempt\(s\); last error: .*[Rr]efused") as err:
        reward.score_group(["1", "2"], ITEM)
    assert url in str(err.value)
    assert len(waits) == 2 and 0.05 <= waits[0] <= 0.1 and 0.1 <= waits[1] <= 0.15  # doubled, capped, plus jitter


def test_overload_and_server_errors_are_retried_with_backoff(fake_server):
    replies = iter([(503, {"error": "busy"}), (500, {"error": "oops"})])
    server = fake_server(lambda body, headers: next(replies, None) or by_length(body, headers))
    clock = FakeClock()
    waits, sleep = recording(clock)
    reward = RemoteReward(server.url, retries=2, backoff_s=0.1, max_backoff_s=1.0, clock=clock, sleep=sleep)
    assert reward.score_group(["1", "12"], ITEM) == [1.0, 2.0]
    assert len(server.requests) == 3
    assert len(waits) == 2 and 0.1 <= waits[0] <= 0.2 and 0.2 <= waits[1] <= 0.3  # 0.1 then 0.2 s, plus jitter


@pytest.mark.parametrize(
    "status, payload, match",
    [
        (400, {"error": "'responses' must be a list of strings", "field": "responses"}, "HTTP 400 .*responses"),
        (401, {"error": "missing or wrong bearer token"}, "HTTP 401"),
        (200, {"rewards": [1.0]}, "a list of 2 numbers"),  # one score for two responses
        (200, {"rewards": [1.0, "high"]}, "a list of 2 numbers"),
        (200, {"scores": [1.0, 2.0]}, "expected a JSON object with 'rewards'"),
        (200, b"<html>proxy error</html>", "expected a JSON object with 'rewards'"),
    ],
)
def test_rejections_and_bad_replies_fail_at_once_without_retries(fake_server, status, payload, match):
    server = fake_server(lambda body, headers: (status, payload))
    reward = RemoteReward(server.url, retries=3, backoff_s=1.0)
    with pytest.raises(RemoteRewardError, match=match):
        reward.score_group(["1", "12"], ITEM)
    assert len(server.requests) == 1


def test_a_slow_server_times_out_within_the_attempts(fake_server):
    def stall(body, headers):
        server.release.wait(30)
        return by_length(body, headers)

    server = fake_server(stall)
    # Real time, twice 0.3 s: the timeout is the socket's, which no injected clock drives.
    with pytest.raises(RemoteRewardError, match=r"after 2 attempt\(s\); last error: no reply within timeout_s=0.3"):
        RemoteReward(server.url, timeout_s=0.3, retries=1, backoff_s=0.05).score_group(["1"], ITEM)
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "backoff_s, attempts, ended_s",
    [
        (0.0, 3, 0.6),  # attempts at 0, 0.2 and 0.4 s (the last with a timeout cut to the 0.1 s left); none at 0.6
        (1.0, 1, 0.5),  # the wait after the first attempt is cut to the 0.3 s left, and no second one starts
    ],
)
def test_the_deadline_ends_a_call_whatever_retries_are_left(fake_server, backoff_s, attempts, ended_s):
    clock = FakeClock()

    def slow_and_busy(body, headers):
        clock.advance(0.2)  # each attempt takes 0.2 s
        return 503, {"error": "busy"}

    server = fake_server(slow_and_busy)
    reward = RemoteReward(server.url, retries=100, backoff_s=backoff_s, deadline_s=0.5, clock=clock, sleep=clock.sleep)
    with pytest.raises(
        RemoteRewardError, match=rf"after {attempts} attempt\(s\) within deadline_s=0.5; last error: HTTP 503"
    ):
        reward.score_group(["1"], ITEM)
    assert len(server.requests) == attempts and clock() - 1000.0 == pytest.approx(ended_s)


def test_at_most_max_in_flight_requests_are_open_across_threads(fake_server):
    gate = threading.Semaphore(0)  # each request is held until the test lets one go

    def held(body, headers):
        assert gate.acquire(timeout=30)
        return by_length(body, headers)

    server = fake_server(held)
    reward = RemoteReward(server.url, max_in_flight=2)
    results: list[list[float]] = []
    threads = [
        threading.Thread(target=lambda k=k: results.append(reward.score_group(["1"] * k, ITEM))) for k in range(1, 7)
    ]
    for t in threads:
        t.start()
    for released in range(6):  # with `released` answered, the client has the next two (or the one left) open
        expected_open = min(2, 6 - released)
        assert server.wait_until(
            lambda n=released + expected_open, k=expected_open: len(server.requests) == n and server.open == k
        ), (len(server.requests), server.open)
        gate.release()
    for t in threads:
        t.join(30)
    assert sorted(len(r) for r in results) == [1, 2, 3, 4, 5, 6]
    assert len(server.requests) == 6 and server.max_open == 2


def test_connections_are_kept_alive_and_loopback_skips_the_environments_proxy(fake_server, monkeypatch):
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # a proxy that is not there
    server = fake_server(by_length, keep_alive=True)
    reward = RemoteReward(server.url)
    assert reward.score_group(["1"], ITEM) == [1.0] and reward.score_group(["12"], ITEM) == [2.0]
    assert len(set(server.ports)) == 1, "the second request went over the first one's connection"
    reward.close()


def test_a_reply_past_the_size_cap_is_refused(fake_server, monkeypatch):
    from asyncrl.tasks import remote_reward

    monkeypatch.setattr(remote_reward, "MAX_REPLY_BYTES", 100)
    server = fake_server(lambda body, headers: (200, {"rewards": [1.0], "padding": "x" * 200}))
    with pytest.raises(RemoteRewardError, match="reply longer than 100 bytes"):
        RemoteReward(server.url).score_group(["1"], ITEM)


def test_the_bearer_token_comes_from_a_file_and_stays_on_the_configured_host(fake_server, tmp_path):
    other = fake_server(by_length)  # a redirect target must never see the token
    server = fake_server(
        lambda body, headers: by_length(body, headers) if body["responses"] != ["go"] else (307, other.url.encode())
    )
    (tmp_path / "token").write_text("s3cret\n")
    reward = RemoteReward(server.url, token_file=str(tmp_path / "token"))
    assert reward.score_group(["1"], ITEM) == [1.0]
    assert server.requests[0][1]["Authorization"] == "Bearer s3cret"
    with pytest.raises(RemoteRewardError, match="HTTP 307"):
        reward.score_group(["go"], ITEM)
    assert other.requests == []

    with pytest.raises(ValueError, match="cannot read token_file"):
        RemoteReward(server.url, token_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="must hold one token"):
        RemoteReward(server.url, token_file=str(tmp_path / "empty"))


@pytest.mark.parametrize(
    "url, kwargs, match",
    [
        ("file:///etc/passwd", {}, "expected an http"),
        ("http://user:pw@127.0.0.1:1/score", {}, "token_file, not in the URL"),
        ("http://127.0.0.1:1/score", {"timeout_s": 0}, "timeout_s must be a positive"),
        ("http://127.0.0.1:1/score", {"max_in_flight": 0}, "max_in_flight >= 1"),
    ],
)
def test_bad_settings_fail_at_construction(url, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RemoteReward(url, **kwargs)


def make_worker(reward: RemoteReward):
    from asyncrl.config import load_config
    from generators.worker import GeneratorWorker

    return GeneratorWorker(
        load_config(None, ["--generator.samples_per_prompt=3"]),
        "gen-0",
        SimpleNamespace(version=0),
        prompt_ids=lambda item: [1],
        items=[ITEM],
        reward_fn=reward,
        client=None,
        writer=None,
    )


def samples(*texts: str) -> list:
    from generators.base import Sample

    return [Sample([5], [-0.1], [0], "stop", text) for text in texts]


def test_the_generator_marks_a_group_failed_and_counts_it_when_the_server_is_down():
    worker = make_worker(RemoteReward(f"http://127.0.0.1:{free_port()}/score", retries=1, backoff_s=0.01))
    assert worker._score(samples("1", "2", "3"), ITEM, ["g-0", "g-1", "g-2"]) == [None, None, None]
    assert worker.reward_failures == {"RemoteRewardError": 3}


def test_the_generator_sends_a_group_in_one_request(fake_server):
    server = fake_server(by_length)
    worker = make_worker(RemoteReward(server.url))
    assert worker._score(samples("1", "12", "123"), ITEM, ["g-0", "g-1", "g-2"]) == [1.0, 2.0, 3.0]
    assert len(server.requests) == 1


# The example server -----------------------------------------------------------------------------------------

SERVER = ROOT / "examples" / "reward_server.py"
TOKEN = "tok-123"


def start_server(model_dir: Path, port: int, *extra: str, log_path: Path) -> subprocess.Popen:
    """Start examples/reward_server.py and wait until its /health answers (or it exits)."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--model", str(model_dir), "--port", str(port), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    deadline = time.monotonic() + 120  # real time: another process loads a model, however long that takes here
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward server exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if json.loads(reply.read())["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(0.2)  # not listening yet: ask again
    stop_process(proc)
    raise RuntimeError(f"reward server not up within 120 s: {log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-rm")
    subprocess.run(
        [sys.executable, str(SERVER), "--make-tiny-model", str(out)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def reward_server(tiny_reward_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "token").write_text(TOKEN + "\n")
    port = free_port()
    proc = start_server(
        tiny_reward_model,
        port,
        "--token-file",
        str(folder / "token"),
        "--max-batch-size",
        "4",
        log_path=folder / "server.log",
    )
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}/score", token_file=str(folder / "token"), pid=proc.pid)
    stop_process(proc)


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method="POST"), timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_the_server_scores_what_the_model_scores_in_process(reward_server, tiny_reward_model):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = RemoteReward(reward_server.url, token_file=reward_server.token_file, max_in_flight=4)
    groups = [("12=", ["12", "21", "1", "", "1212121"]), ("907=", ["907", "7", "0000", "9=9"])]
    results: dict[str, list[float]] = {}
    threads = [
        threading.Thread(target=lambda p=p, r=r: results.__setitem__(p, reward.score_group(r, {"prompt": p})))
        for p, r in groups
    ]  # concurrent groups share forward passes on the server; scores must not mix
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    for prompt, responses in groups:
        with torch.inference_mode():
            expected = [model(**tokenizer(prompt + r, return_tensors="pt")).logits[0, 0].item() for r in responses]
        assert results[prompt] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert len(set(results["12="])) == 5, "a random model scores different texts differently"


@pytest.mark.slow
def test_a_malformed_request_gets_a_400_naming_the_field_and_the_server_goes_on(reward_server):
    url = reward_server.url
    cases = [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (json.dumps({"responses": ["1"]}).encode(), "prompts"),
        (json.dumps({"prompts": ["1="], "responses": [3]}).encode(), "responses"),
        (json.dumps({"prompts": ["1=", "2="], "responses": ["1"]}).encode(), "prompts"),
        (json.dumps({"prompts": ["1="], "responses": ["1"], "labels": "1"}).encode(), "labels"),
    ]
    for body, field in cases:
        status, reply = post(url, body)
        assert (status, reply["field"]) == (400, field), reply
    status, reply = post(url, json.dumps({"prompts": ["1="], "responses": ["not digits"]}).encode())
    assert status == 422 and "cannot be tokenized" in reply["error"]
    status, reply = post(url, json.dumps({"prompts": ["1="], "responses": ["1"], "labels": [None]}).encode())
    assert status == 200 and len(reply["rewards"]) == 1


@pytest.mark.slow
def test_the_token_is_required_when_the_server_has_one(reward_server):
    body = json.dumps({"prompts": ["1="], "responses": ["1"]}).encode()
    assert post(reward_server.url, body, token=None)[0] == 401
    assert post(reward_server.url, body, token="wrong")[0] == 401
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        RemoteReward(reward_server.url).score_group(["1"], {"prompt": "1="})
    assert post(reward_server.url, body)[0] == 200
    with urllib.request.urlopen(reward_server.url.replace("/score", "/health"), timeout=5) as reply:
        health = json.loads(reply.read())  # no token needed to check liveness
    assert health["status"] == "ok" and health["samples"] >= 1


def test_the_server_refuses_a_non_loopback_host_without_a_token_file(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SERVER), "--model", str(tmp_path), "--host", "0.0.0.0", "--port", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "give --token-file" in out.stderr
