"""Shared fixtures and helpers: valid rollouts, free loopback ports, a run's accounting."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.wire.ports import free_port  # tests' services get ports outside the ephemeral range too

ROOT = Path(__file__).resolve().parents[1]
if not shutil.which("nvidia-smi"):  # CPU machines: DeepSpeed's CPU accelerator; GPU ones keep CUDA
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


# One torch thread per process, as `asyncrl run` gives several processes on two cores: tests that start
# asyncrl-learner and asyncrl-generator themselves pass it (more threads than cores made a learner step 3x slower).
ONE_THREAD_EACH = ["--learner.torch_threads=1", "--generator.torch_threads=1"]


# The slow tier's longest files (seconds of test time on 2 cores, 2026-12-07), handed to the two workers first:
# pytest-xdist gives a worker a whole file at a time, in collection order (scripts/test.sh turns off its own
# ordering by count of tests for that tier), and a long file handed out last leaves the other worker idle at
# the end: 73 s of a 1,054 s tier in xdist's own order (by count of tests). The other files follow in their
# usual order.
LONGEST_FILES_FIRST = (
    "test_integration.py",  # 342 s
    "test_algo.py",  # 284 s
    "test_task_run.py",  # 232 s
    "test_learner_group.py",  # 142 s
    "test_vllm_pool.py",  # 137 s
    "test_learning_cpu.py",  # 115 s
    "test_control_plane.py",  # 88 s
    "test_models.py",  # 82 s
    "test_sweep.py",  # 77 s
    "test_chaos.py",  # 71 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


class FakeClock:
    """A clock that moves only when a test moves it, for components that take ``clock=`` (and ``sleep=``).

    ``clock()`` reads it (seconds, like ``time.monotonic``), ``advance(s)`` moves it, and ``sleep(s)`` advances it
    instead of waiting, so a 30 s lease expires in a test that takes milliseconds.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    sleep = advance


def loopback_ports() -> list[str]:
    """Overrides that give a run's buffer and coordinator free loopback ports."""
    return [f"--buffer.address=tcp://127.0.0.1:{free_port()}", f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def asyncrl_run(config: str, run_dir: Path, *overrides: str, timeout_s: float = 600, env: dict | None = None):
    """``asyncrl run CONFIG`` as a user types it, on free loopback ports, bounded by ``timeout_s`` (in ``env``:
    the test's own environment by default); the finished process (``returncode``, captured ``stdout`` and
    ``stderr``)."""
    import subprocess

    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", str(ROOT / config), "--run-dir", str(run_dir)]
    command += ["--free-ports", "--timeout-s", f"{timeout_s:g}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 100, cwd=ROOT, env=env)


def publish_adapter(peft_model, weights_dir: Path, version: int, model_dir: str | Path):
    """A LoRA learner's version of ``peft_model``, published as its folder sender writes one; the announcement."""
    from asyncrl.weights import folders
    from asyncrl.weights.adapters import AdapterView

    view = AdapterView(peft_model)
    return folders.publish(
        view.named_parameters(),
        version=version,
        weights_dir=weights_dir,
        model_dir=model_dir,
        config_json=view.config.to_json_string(),
        adapter_config_json=view.adapter_config_json,
        keep_versions=100,
    )


def accounted(run_dir: Path) -> list[dict]:
    """consumed.jsonl and dropped.jsonl against summary.json, exactly; returns the consumed records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    consumed, dropped = _jsonl(run_dir / "consumed.jsonl"), _jsonl(run_dir / "dropped.jsonl")
    ids = [c["id"] for c in consumed]
    assert len(set(ids)) == len(ids), "no rollout trained on twice"
    assert len(ids) == summary["samples_consumed"]
    # summary.json's drops are exactly the records of dropped.jsonl, reason by reason.
    assert summary["samples_dropped"] == dict(Counter(d["reason"] for d in dropped))
    assert not set(ids) & {d["id"] for d in dropped}, "a rollout is trained on or dropped, not both"
    return consumed


def make_rollout(
    i: int = 0,
    group: str = "s-g0",
    group_size: int = 1,
    versions: list[int] | None = None,
    reward: float = 0.5,
    n_tokens: int = 3,
):
    from asyncrl.wire.protocol import Rollout

    versions = versions or [0] * n_tokens
    return Rollout(
        rollout_id=f"{group}-{i}",
        group_id=group,
        group_size=group_size,
        prompt_index=i,
        prompt_ids=[1, 4, 5, 13],
        response_ids=[5, 4, 2][: len(versions)] + [3] * max(0, len(versions) - 3),
        logprobs=[-0.5] * len(versions),
        versions=versions,
        reward=reward,
        finish_reason="stop",
        generator_id="gen-0",
        created_s=0.0,
    )


def rollouts_of_lengths(lengths: list[tuple[int, int]]) -> list:
    """One rollout per ``(prompt, response)`` length pair, random token ids below 1,000 (seeded)."""
    import torch

    from asyncrl.wire.protocol import Rollout

    generator = torch.Generator().manual_seed(3)
    rollouts = []
    for i, (prompt, response) in enumerate(lengths):
        ids = torch.randint(5, 1000, (prompt + response,), generator=generator).tolist()
        rollouts.append(
            Rollout(
                rollout_id=f"r{i}",
                group_id="g",
                group_size=1,
                prompt_index=i,
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt:],
                logprobs=[0.0] * response,
                versions=[0] * response,
                reward=0.0,
                finish_reason="stop",
                generator_id="gen-0",
                created_s=0.0,
            )
        )
    return rollouts


def spike_state(model_dir: Path, token: int) -> dict:
    """Weights of the model in ``model_dir`` under which ``token`` is sampled with probability ~1 whatever
    the context.

    Attention and MLP outputs are zeroed, so the last hidden state is the
    normalised embedding; every embedding is the unit vector e0, and only
    ``lm_head[token]`` looks at e0, with a logit of ~113 against 0 for the rest.
    """
    from safetensors.torch import load_file

    state = load_file(Path(model_dir) / "model.safetensors")
    for name, tensor in state.items():
        if "o_proj" in name or "down_proj" in name:
            tensor.zero_()
    state["model.embed_tokens.weight"].zero_()
    state["model.embed_tokens.weight"][:, 0] = 1.0
    state["model.norm.weight"].fill_(1.0)
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][token, 0] = 10.0
    return state


class DirectClient:
    """A generator's coordinator client that calls the coordinator in process instead of over ZeroMQ."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.address = "inproc"

    def call(self, request, expected):
        return self.coordinator.handle_work(request)

    def watch(self, request, hold_s, clock=None):
        """A held request, in process: each look asks the coordinator as the server's rechecks do."""
        return DirectWatch(self.coordinator, request)


class DirectWatch:
    """:class:`~asyncrl.control.watch.VersionWatch` in process: a look sends a request when none is held, and
    answers it once the coordinator has something to say (a newer version)."""

    def __init__(self, coordinator, request) -> None:
        self.coordinator, self._request, self._held = coordinator, request, None

    def newest(self):
        if self._held is None:
            self._held = self._request()
            return None
        reply = self.coordinator.handle_work(self._held, final=False)
        if reply is not None:
            self._held = None
        return reply

    def close(self) -> None:
        pass


def stop_process(proc) -> None:
    """SIGTERM a test's subprocess by its PID, SIGKILL it if it outlives 10 s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def _gpu_memory_released(request):
    """A GPU test's tensors go with it: the engines a later test starts size themselves from the free memory, and
    this process's cached blocks would count against them."""
    yield
    torch = sys.modules.get("torch")
    if request.node.get_closest_marker("gpu") is None or torch is None or not torch.cuda.is_initialized():
        return
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def rollout_factory():
    return make_rollout


@pytest.fixture
def tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


def one_generator_push(folder: Path, timeout_s: float):
    """A push group of the learner's rank 0 and one generator on a free loopback port, with its secret in
    ``folder``: what a test that plays both ends opens."""
    from asyncrl.config import PushConfig

    secret = folder / "push.secret"
    secret.write_text("known to the test's two ends\n")
    return PushConfig(address=f"127.0.0.1:{free_port()}", generators=1, timeout_s=timeout_s, secret_file=str(secret))


def offered_files(address: str, version: int, base: int) -> dict[str, int]:
    """The files the server lists for ``version`` to a client holding ``base``."""
    import zmq

    from asyncrl.wire.protocol import WeightChunk, WeightFetch, decode, encode
    from asyncrl.wire.sockets import Endpoint

    endpoint = Endpoint(zmq.DEALER, address, bind=False, field="test")
    try:
        endpoint.socket.send_multipart([b"", encode(WeightFetch(version=version, base=base))])
        assert endpoint.socket.poll(10_000), "the server did not answer within 10 s"
        return decode(endpoint.socket.recv_multipart()[-1], WeightChunk).files
    finally:
        endpoint.close()


def wait_for(condition, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until another thread or process makes it true, failing after ``timeout_s``.

    Real time on purpose: what is awaited is the other side's work (a server thread answering, a process
    starting), not the passing of a timeout, which tests drive with :class:`FakeClock` instead.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.02)
