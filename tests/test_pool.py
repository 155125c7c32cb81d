"""Several runs, one engine (generators.pool): what the runs may share, and what never crosses between them."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import ConfigError, check_shared_engine, load_config
from generators.base import GenerationRequest, SamplingParams
from generators.pool import Lane, SharedEngine, Turns

LORA = ["--learner.lora.rank=4", "--generator.backend=vllm"]


def run(name: str, port: int, *overrides: str):
    return load_config(
        None,
        [
            f"--name={name}",
            f"--run_dir=runs/{name}",
            f"--buffer.address=tcp://127.0.0.1:{port}",
            f"--coordinator.address=tcp://127.0.0.1:{port + 1}",
            *LORA,
            *overrides,
        ],
    )


def test_runs_of_one_base_with_adapters_and_their_own_addresses_share_a_pool():
    check_shared_engine([run("a", 7000), run("b", 7002, "--learner.lora.rank=16")], ["a.yaml", "b.yaml"])


@pytest.mark.parametrize(
    "b, message",
    [
        (run("b", 7002, "--learner.lora.rank=0"), "b.yaml: learner.lora.rank: runs that share a generator"),
        (run("b", 7002, "--generator.backend=transformers"), "b.yaml: generator.backend: runs share a vLLM engine"),
        (run("b", 7002, "--model.path=other"), "b.yaml: model.path differs from a.yaml's"),
        (run("b", 7002, "--generator.vllm.max_model_len=512"), "b.yaml: generator.vllm differs from a.yaml's"),
        (run("a", 7002), "b.yaml: name: 'a' is a.yaml's too"),
        (
            run("b", 7002, "--buffer.address=tcp://127.0.0.1:7000"),
            "b.yaml: buffer.address: 'tcp://127.0.0.1:7000' is a.yaml's too",
        ),
        (
            run("b", 7002, "--coordinator.address=tcp://127.0.0.1:7001"),
            "b.yaml: coordinator.address: 'tcp://127.0.0.1:7001' is a.yaml's too",
        ),
        (run("b", 7002, "--prometheus.generator_port=9100"), "b.yaml: prometheus.generator_port: 9100 is a.yaml's too"),
    ],
)
def test_a_run_that_cannot_share_the_engine_is_refused_naming_its_file_and_key(b, message):
    a = run("a", 7000, "--prometheus.generator_port=9100") if "generator_port" in message else run("a", 7000)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_shared_engine([a, b], ["a.yaml", "b.yaml"])


class FakeEngine:
    """The slice of VllmBackend a pool drives: requests finish at the step after they were added, their one
    sample labelled with the engine's label when they were added."""

    tokenizer = None

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.running: dict[str, tuple[list[int], object, int]] = {}
        self.label = 0
        self.steps = 0
        self.aborted: list[str] = []
        self.never: set[int] = set()  # requests whose prompt starts with one of these run until aborted

    def sampling(self, params):
        return params

    def add(self, prompt_ids, sampling, adapter=None, salt=None):
        request_id = f"r{next(self.ids)}"
        self.running[request_id] = (list(prompt_ids), adapter, self.label)
        return request_id

    def step(self):
        self.steps += 1
        finished = [rid for rid, (prompt, _, _) in self.running.items() if prompt[:1] not in ([n] for n in self.never)]
        done = {rid: self.running.pop(rid) for rid in finished}
        return [
            SimpleNamespace(
                request_id=rid,
                outputs=[SimpleNamespace(index=0, token_ids=[*prompt, adapter], label=label)],
            )
            for rid, (prompt, adapter, label) in done.items()
        ]

    def sample(self, completion, started_version, version_of=None):
        tokens = completion.token_ids
        return SimpleNamespace(token_ids=tokens, versions=[version_of(completion.label)] * len(tokens))

    def abort(self, request_ids):
        self.aborted += request_ids
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def relabel(self, label):
        self.label = label

    def stage(self, folder, version):
        return folder

    def close(self):
        pass


class FakeSlot:
    def __init__(self, name: str) -> None:
        self.name, self.request, self.loaded = name, f"adapter-{name}", []

    def prepare(self, folder, version, timeout_s, stage):
        return stage(folder, version)

    def swap_in(self, staged, version):
        self.loaded.append(version)


@pytest.fixture
def pool():
    engine = SharedEngine(FakeEngine())
    yield engine, Lane(engine, FakeSlot("a")), Lane(engine, FakeSlot("b"))
    engine.close()


def test_each_run_gets_back_exactly_its_own_requests_sampled_with_its_own_adapter(pool):
    engine, a, b = pool
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    got: dict[str, list] = {}

    def ask(lane: Lane, name: str) -> None:
        requests = [GenerationRequest(f"{name}{i}", [i]) for i in range(50)]
        got[name] = [(req.request_id, samples[0].token_ids) for req, samples in lane.generate(requests, params)]

    threads = [threading.Thread(target=ask, args=(lane, name)) for lane, name in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for name in ("a", "b"):
        assert sorted(got[name]) == sorted((f"{name}{i}", [i, f"adapter-{name}"]) for i in range(50))


def test_a_version_of_one_run_swaps_its_slot_alone_and_labels_tokens_with_each_runs_own_version(pool):
    engine, a, b = pool
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    a.load_folder(Path("a/v7"), 7, timeout_s=5)
    b.load_folder(Path("b/v2"), 2, timeout_s=5)
    a.load_folder(Path("a/v8"), 8, timeout_s=5)
    assert (a.slot.loaded, b.slot.loaded) == ([7, 8], [2])
    assert (a.version, b.version) == (8, 2)
    # the engine's label counts swaps of either run: each run reads its own version at every label
    assert [a.version_at(label) for label in range(4)] == [0, 7, 7, 8]
    assert [b.version_at(label) for label in range(4)] == [0, 0, 2, 2]
    [(_, [sample_a])] = list(a.generate([GenerationRequest("a", [1])], params))
    [(_, [sample_b])] = list(b.generate([GenerationRequest("b", [1])], params))
    assert (sample_a.versions[0], sample_b.versions[0]) == (8, 2)
    assert a.salt != b.salt


def test_a_run_that_stops_early_aborts_its_requests_and_the_other_run_is_untouched(pool):
    engine, a, b = pool
    engine.backend.never = {1, 2}  # still running when the first comes back
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    stream = a.generate([GenerationRequest(f"a{i}", [i]) for i in range(3)], params)
    next(stream)
    stream.close()
    assert len(engine.backend.aborted) == 2, "the requests left were aborted"
    assert [req.request_id for req, _ in b.generate([GenerationRequest("b0", [0])], params)] == ["b0"]
    assert a.done.empty(), "nothing of a's arrives after it stopped"


def test_an_engine_that_fails_is_raised_in_every_run(pool):
    engine, a, b = pool

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access")

    engine.backend.step = broken
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    for lane in (a, b):
        with pytest.raises(RuntimeError, match="the shared engine stopped: CUDA error"):
            list(lane.generate([GenerationRequest("x", [1])], params))


def test_a_run_waiting_for_the_engine_goes_before_the_engine_threads_next_step():
    """The engine thread lets go of the lock after a step and asks for it again at once; a run that waited
    meanwhile gets it first. (With a plain lock the engine thread mostly took it back, and runs could add
    requests or swap adapters only once the engine ran dry.)"""
    turns = Turns()
    order: list[str] = []

    def run_call() -> None:
        with turns.turn():
            order.append("run")

    for step in range(20):
        with turns.turn():
            call = threading.Thread(target=run_call)
            call.start()
            deadline = time.monotonic() + 10
            while turns.waiting < 2 and time.monotonic() < deadline:  # the run now waits for the lock
                pass
            order.append(f"step {step}")
        with turns.turn():  # the engine thread's next step, asked for at once
            order.append(f"step {step}+1")
        call.join(timeout=10)
        assert order[-3:] == [f"step {step}", "run", f"step {step}+1"], order[-3:]


def test_a_run_calling_in_a_loop_does_not_shut_the_engine_out():
    """A run adding request after request takes turns with the engine's steps, one call between two steps."""
    turns = Turns()
    calls, steps = [0], []

    def adds() -> None:
        for _ in range(2000):
            with turns.turn():
                calls[0] += 1

    adding = threading.Thread(target=adds)
    with turns.turn():
        adding.start()
        deadline = time.monotonic() + 10
        while turns.waiting < 2 and time.monotonic() < deadline:  # the run is in its loop
            pass
    for _ in range(20):
        with turns.turn():
            steps.append(calls[0])
    adding.join(timeout=30)
    assert calls[0] == 2000
    assert steps[-1] <= 21, steps  # not the run's 2,000 calls first


def test_a_run_adds_requests_and_swaps_its_adapter_while_the_engine_never_idles(pool):
    engine, a, b = pool
    engine.backend.never = {9}
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    b.add([9], params)  # the engine steps throughout
    for i in range(10):
        a.load_folder(Path(f"a/v{i}"), i, timeout_s=5)
        [(_, [sample])] = list(a.generate([GenerationRequest(f"a{i}", [10 + i])], params))
        assert sample.versions[0] == i
    assert a.slot.loaded == list(range(10))


def test_an_asker_that_stops_waiting_gives_up_its_turn():
    """A thread interrupted while it waits for its turn (Ctrl-C, say) does not leave the askers behind it
    waiting for a turn nobody takes."""
    turns = Turns()
    interrupted = threading.Event()
    first = turns.turn()
    first.__enter__()  # a step under way
    waiting = turns.turn()

    def interrupt_the_wait(predicate, timeout=None):
        interrupted.set()
        raise KeyboardInterrupt

    real_wait_for = turns._changed.wait_for
    turns._changed.wait_for = interrupt_the_wait
    with pytest.raises(KeyboardInterrupt):
        waiting.__enter__()
    turns._changed.wait_for = real_wait_for
    assert interrupted.is_set() and turns.waiting == 2
    first.__exit__(None, None, None)
    with turns.turn():  # the ticket after the one given up
        assert turns.waiting == 1
