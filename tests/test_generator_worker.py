"""The generator loop against an in-process coordinator and buffer, with a scripted backend and with
the transformers backend, which is asked for by name (``generator.backend: auto`` picks vLLM wherever it
is installed, which would leave the reference backend untested)."""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch
from conftest import ROOT, DirectClient, FakeClock, spike_state
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.config import BufferConfig, RunConfig, load_config
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.staleness import StalenessBound
from asyncrl.weights import folders
from asyncrl.weights.transports import announce_push
from asyncrl.wire.protocol import Ack, EvalReport, EvalTicket, WeightUpdate, WorkRequest
from buffers import BufferTimeout, open_reader, open_writer
from generators import open_backend
from generators.base import GenerationRequest, PromptRefused, Sample, SamplingParams
from generators.hf_backend import TransformersBackend
from generators.scoring import Scorer
from generators.worker import GeneratorWorker


def waits_on(clock: FakeClock):
    """How a worker or scorer driven by ``clock`` waits for a reward in its thread: until the call is done, or
    until the fake clock reads ``until``. A test's reward that stands for a slow one moves the clock itself."""

    def wait_until(future: concurrent.futures.Future, until: float) -> None:
        while not future.done() and clock() < until:
            # Real time, in slices: the reward runs in a real thread, and a fake clock wakes nobody.
            concurrent.futures.wait([future], timeout=0.01)

    return wait_until


@pytest.fixture
def fake_time() -> FakeClock:
    """One fake clock for the coordinator's leases and the worker's heartbeats.

    Each test that uses it also has a silent generator lose its lease, so that it fails, rather than passes for
    nothing, should the coordinator stop reading the clock it is given.
    """
    return FakeClock()


def _silent_generator_takes_a_ticket(coordinator: Coordinator) -> None:
    """A generator that takes one ticket and is never heard of again: its lease runs out, and only its."""
    reply = coordinator.handle_work(WorkRequest(generator_id="silent", weight_version=0, max_groups=1))
    assert len(reply.tickets) == 1


class ScriptedBackend:
    """Yields one group at a time; ``v1`` (a real published folder) is announced while the second is sampled."""

    def __init__(self, coordinator: Coordinator, v1: WeightUpdate | None = None, batches: int = 1) -> None:
        self.coordinator = coordinator
        self.v1 = v1
        self.version = 0
        self.loaded: list[int] = []
        self.batches = batches  # the learner says stop after this many

    def generate(self, requests, params, between_steps=None):
        self.batches -= 1
        if between_steps is not None:  # engine steps before the first group is done
            between_steps()
        for k, request in enumerate(requests):
            yield request, [Sample([5, 2], [-0.1, -0.2], [self.version] * 2, "stop", "3") for _ in range(params.n)]
            if k == 0 and self.coordinator.latest is None:
                self.coordinator.publish(self.v1)
            if k == len(requests) - 1 and self.batches == 0:
                self.coordinator.stop()
            elif between_steps is not None:  # the engine steps on to the next group
                between_steps()

    def load_folder(self, folder, version, timeout_s):
        assert (folder / "model.safetensors").exists()
        self.loaded.append(version)
        self.version = version


def _run(update_in_flight: bool, tmp_path, batches: int = 1) -> tuple[list[list[int]], list[int]]:
    config = load_config(
        None,
        [
            f"--generator.update_in_flight={update_in_flight}",
            "--generator.update_poll_s=0",
            "--generator.samples_per_prompt=2",
            "--generator.groups_per_request=3",
        ],
    )
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address=f"worker-{time.monotonic_ns()}", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    v1 = folders.publish(
        [("w", torch.zeros(2))], version=1, weights_dir=tmp_path, model_dir=ROOT / "assets/tiny-llama", config_json="{}"
    )
    backend = ScriptedBackend(coordinator, v1, batches)
    items = [{"prompt": "12=", "answer": "12"}] * 10
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1, 4, 5, 13],
        items=items,
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=writer,
    )
    worker.run()
    rollouts = reader.get(max_items=100, timeout_s=1)
    return [r.versions for r in rollouts], backend.loaded


def test_update_lands_mid_batch_when_in_flight_updates_are_on(tmp_path):
    versions, loaded = _run(update_in_flight=True, tmp_path=tmp_path)
    assert loaded == [1]
    # v1 appears after group 0; the request the worker holds at the learner (sent at the first engine step)
    # is answered, and the worker loads v1 at the next engine step, before group 1 is sampled.
    assert versions == [[0, 0]] * 2 + [[1, 1]] * 4


def test_update_waits_for_the_batch_when_off(tmp_path):
    versions, loaded = _run(update_in_flight=False, tmp_path=tmp_path, batches=2)
    assert versions == [[0, 0]] * 6 + [[1, 1]] * 6
    assert loaded == [1]  # applied before the next request


def test_a_learner_that_is_done_is_not_asked_for_its_last_version(tmp_path):
    # Its weight server may be gone already: loading first would hold the generator's exit for a timeout.
    versions, loaded = _run(update_in_flight=False, tmp_path=tmp_path, batches=1)
    assert versions == [[0, 0]] * 6
    assert loaded == []


class RecordingClient(DirectClient):
    """Keeps every request the worker sends."""

    def __init__(self, coordinator) -> None:
        super().__init__(coordinator)
        self.requests: list[WorkRequest] = []

    def call(self, request, expected):
        self.requests.append(request)
        return super().call(request, expected)


class Undurable:
    """A writer whose rollouts may still be queued in the generator's process when ``put`` returns (ZeroMQ)."""

    durable = False

    def __init__(self, writer) -> None:
        self.put, self.close = writer.put, writer.close


@pytest.mark.parametrize("durable", [True, False])
def test_groups_written_to_a_durable_buffer_are_reported_once_each(durable, tmp_path):
    """So that the learner waits for them, not generates them again, should this generator be lost."""
    config = load_config(
        None, ["--generator.update_poll_s=0", "--generator.samples_per_prompt=2", "--generator.groups_per_request=3"]
    )
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address=f"worker-written-{durable}", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    client = RecordingClient(coordinator)
    v1 = folders.publish(
        [("w", torch.zeros(2))], version=1, weights_dir=tmp_path, model_dir=ROOT / "assets/tiny-llama", config_json="{}"
    )
    worker = GeneratorWorker(
        config,
        "gen-0",
        ScriptedBackend(coordinator, v1, batches=2),
        prompt_ids=lambda item: [1],
        items=[{"prompt": "1"}] * 10,
        reward_fn=lambda text, item: 1.0,
        client=client,
        writer=writer if durable else Undurable(writer),
    )
    worker.run()
    groups = list(dict.fromkeys(r.group_id for r in reader.get(max_items=100, timeout_s=1)))
    assert len(groups) == 6
    reported = [group_id for request in client.requests for group_id in request.written]
    assert reported == (groups if durable else [])
    if durable:  # each as soon as the next request goes out: the engine's next step, when it polls for weights
        first = next(i for i, r in enumerate(client.requests) if r.written)
        assert [r.written for r in client.requests[first : first + 3]] == [[g] for g in groups[:3]]


def test_config_round_trips_the_new_fields():
    config = load_config(None, ["--generator.update_in_flight=false"])
    assert msgspec.convert(msgspec.to_builtins(config), RunConfig).generator.update_in_flight is False


def test_a_failed_push_is_not_retried_until_the_next_one():
    """A push is a one-off broadcast: retrying its announcement would only wait out the timeout again."""
    config = load_config(None, ["push.address=127.0.0.1:29999", "push.secret_file=push.secret"])
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address="worker-push", capacity=100)

    class FailingPushes(ScriptedBackend):
        def receive_push(self, epoch, version, timeout_s):
            self.loaded.append(version)
            raise TimeoutError("weight push: nobody sent it")

    backend = FailingPushes(coordinator)
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1],
        items=[{"prompt": "1"}],
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=open_writer(buffer),
    )
    for epoch, version in ((7, 1), (7, 1), (7, 1), (8, 2)):
        worker.weights.apply(announce_push(epoch, version, num_bytes=0))
    assert backend.loaded == [1, 2] and worker.weights.failures == 2


def test_a_version_that_failed_to_load_is_tried_again_after_a_backoff_that_never_sleeps(tmp_path):
    """Mid-batch the engine goes on meanwhile: a sleep there would stall every request in flight."""
    config = load_config(None, [])
    clock = FakeClock()
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")

    class Broken(ScriptedBackend):
        def load_folder(self, folder, version, timeout_s):
            self.loaded.append(version)
            raise OSError("disk full")

    backend = Broken(coordinator)
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1],
        items=[{"prompt": "1"}],
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=open_writer(BufferConfig(type="inproc", address="worker-backoff", capacity=1)),
        clock=clock,
        sleep=lambda s: pytest.fail(f"slept {s}s"),
    )
    v1, v2 = (
        folders.publish(
            [("w", torch.zeros(2))],
            version=v,
            weights_dir=tmp_path,
            model_dir=ROOT / "assets/tiny-llama",
            config_json="{}",
        )
        for v in (1, 2)
    )
    for _ in range(3):  # engine steps in quick succession, within the first backoff (0.2 s)
        worker.weights.apply(v1)
        clock.advance(0.05)
    assert backend.loaded == [1]
    worker.weights.apply(v2)  # a newer version is tried at once
    assert backend.loaded == [1, 2] and worker.weights.retry_at == pytest.approx(clock() + 0.4)
    clock.advance(0.39)  # the second failure in a row: 0.4 s
    worker.weights.apply(v2)
    assert backend.loaded == [1, 2]
    clock.advance(0.02)
    worker.weights.apply(v2)
    assert backend.loaded == [1, 2, 2] and worker.weights.failures == 3
    assert worker.weights.retry_at == pytest.approx(clock() + 0.8)


# --- the transformers backend ------------------------------------------------------------------------------

MODEL = ROOT / "assets/tiny-llama"
TRANSFORMERS = ["--generator.backend=transformers", f"--model.path={MODEL}"]
SEVEN = 10  # the token id of "7" in the character vocabulary


@pytest.fixture
def hf_backend():
    backend = open_backend(load_config(None, TRANSFORMERS))
    assert isinstance(backend, TransformersBackend) and backend.version == 0
    yield backend
    backend.close()


def _reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one unpadded forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def _publish(state: dict[str, torch.Tensor], version: int, weights_dir) -> None:
    folders.publish(
        state.items(),
        version=version,
        weights_dir=weights_dir,
        model_dir=MODEL,
        config_json=(MODEL / "config.json").read_text(),
    )


def test_transformers_backend_returns_the_logprobs_of_what_it_sampled(hf_backend):
    """Prompts of two lengths share one left-padded batch; each sample's behaviour log-probs equal an
    unpadded forward of the same weights, and every token carries the version that served it."""
    torch.manual_seed(0)
    requests = [GenerationRequest("short", [1, 5, 13]), GenerationRequest("long", [1, 5, 6, 7, 8, 9, 13])]
    out = list(hf_backend.generate(requests, SamplingParams(n=4, max_new_tokens=6, temperature=0.7)))
    assert sorted(r.request_id for r, _ in out) == ["long", "short"]
    reference = AutoModelForCausalLM.from_pretrained(MODEL)
    for request, samples in out:
        assert len(samples) == 4
        for sample in samples:
            tokens = sample.token_ids
            assert sample.versions == [0] * len(tokens) and len(sample.logprobs) == len(tokens)
            assert not set(hf_backend.eos_ids) & set(tokens[:-1]), "a sample ends at its first end token"
            if tokens[-1] in hf_backend.eos_ids:
                assert sample.finish_reason == "stop"
            else:
                assert sample.finish_reason == "length" and len(tokens) == 6
            expected = _reference_logprobs(reference, request.prompt_ids, tokens, 0.7)
            assert (torch.tensor(sample.logprobs) - expected).abs().max() < 1e-4, request.request_id


def test_transformers_backend_stops_at_every_end_token_of_the_generation_config(hf_backend, tmp_path):
    # Gemma-it and Llama 3 Instruct end a turn with a token that is not the tokenizer's EOS: their generation
    # config lists it, and vLLM stops there too. Make the token greedy decoding picks first such a one.
    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    [(_, [sample])] = list(hf_backend.generate([GenerationRequest("g", [1, 5, 13])], greedy))
    first = sample.token_ids[0]
    assert first not in hf_backend.eos_ids and len(sample.token_ids) > 1
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [first]}))
    backend = TransformersBackend(str(model))
    [(_, [sample])] = list(backend.generate([GenerationRequest("g", [1, 5, 13])], greedy))
    assert (sample.token_ids, sample.finish_reason) == ([first], "stop")


def test_transformers_backend_ignores_the_folders_sampling_defaults(hf_backend, tmp_path):
    """A repetition penalty in generation_config.json (Qwen2.5-Instruct ships one) would sample from another
    distribution than the log-probs recorded, and than vLLM's: greedy answers stay the model's argmax."""
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**config, "repetition_penalty": 3.0, "top_k": 2, "no_repeat_ngram_size": 1, "min_new_tokens": 12})
    )
    greedy = SamplingParams(n=1, max_new_tokens=12, temperature=0.0)
    requests = [GenerationRequest(f"q{i}", [1, 3 + i, 13]) for i in range(4)]
    penalised = {r.request_id: s[0].token_ids for r, s in TransformersBackend(str(model)).generate(requests, greedy)}
    plain = {r.request_id: s[0].token_ids for r, s in hf_backend.generate(requests, greedy)}
    assert penalised == plain
    assert any(len(set(tokens)) < len(tokens) for tokens in plain.values())  # a token repeats: a penalty would show


def test_transformers_backend_switches_weights_whole_or_not_at_all(hf_backend, tmp_path):
    _publish(spike_state(MODEL, SEVEN), 1, tmp_path)
    hf_backend.load_folder(folders.version_dir(tmp_path, 1), 1, timeout_s=60)
    assert hf_backend.version == 1
    ((_, samples),) = hf_backend.generate([GenerationRequest("g", [1, 5, 13])], SamplingParams(n=3, max_new_tokens=4))
    assert all(s.token_ids == [SEVEN] * 4 and s.versions == [1] * 4 and s.text == "7777" for s in samples)
    # A version that lacks a tensor is refused before anything changes: v1 keeps serving.
    broken = {name: t for name, t in load_file(MODEL / "model.safetensors").items() if name != "lm_head.weight"}
    _publish(broken, 2, tmp_path)
    with pytest.raises(ValueError, match="lm_head.weight"):
        hf_backend.load_folder(folders.version_dir(tmp_path, 2), 2, timeout_s=60)
    assert hf_backend.version == 1
    # A stop string ends the text and the tokens where it matched.
    params = SamplingParams(n=2, max_new_tokens=4, stop=("77",))
    ((_, samples),) = hf_backend.generate([GenerationRequest("g", [1, 5, 13])], params)
    assert all(
        s.token_ids == [SEVEN] * 2 and s.text == "77" and s.finish_reason == "stop" and len(s.logprobs) == 2
        for s in samples
    )


def test_an_evaluation_ends_answers_at_the_training_stop_strings_and_counts_failed_rewards(hf_backend, tmp_path):
    """Judged as training ends them: an answer that ran on past the stop string would be scored on text the
    policy never produces. A reward that fails scores 0 and is marked, not taken for a wrong answer."""
    from asyncrl.control.evaluation import EvalResult
    from generators.evaluate import evaluate

    _publish(spike_state(MODEL, SEVEN), 1, tmp_path)
    hf_backend.load_folder(folders.version_dir(tmp_path, 1), 1, timeout_s=60)
    ticket = EvalTicket(version=1, indices=[0, 1], k=2, temperature=1.0, max_new_tokens=6)

    def reward(text, item):
        if item["prompt"] == "b":
            raise RuntimeError("the judge is down")
        return float(text == "77")

    traces = evaluate(
        hf_backend, ticket, [{"prompt": "a"}, {"prompt": "b"}], lambda item: [1, 5, 13], reward, stop=("77",)
    )
    assert [t.response for t in traces] == ["77"] * 6
    assert [(t.index, t.reward, t.reward_failed) for t in traces if t.greedy] == [(0, 1.0, False), (1, 0.0, True)]
    result = EvalResult(1, 10, 0.5, 0.5, 2, 2, [1], traces)
    assert result.record()["reward_failures"] == 3


def test_the_loop_streams_rollouts_from_the_transformers_backend():
    """The real backend under the worker: whole groups, scored by the task's reward, stamped with v0."""
    config = load_config(
        None,
        [
            *TRANSFORMERS,
            "--generator.samples_per_prompt=4",
            "--generator.groups_per_request=3",
            "--generator.max_new_tokens=4",
        ],
    )
    coordinator = Coordinator(StalenessBound(0, 12), PromptCursor(10, 0), group_size=4, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address="worker-transformers", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    backend = open_backend(config)
    items = [{"prompt": f"{i}{i}{i}=", "answer": f"{i}{i}{i}"} for i in range(10)]

    class StopAfterOneRequest(DirectClient):
        def call(self, request, expected):
            reply = super().call(request, expected)
            if reply.tickets:
                coordinator.stop()  # the learner is done once this request's groups are in
            return reply

    scored: list[str] = []

    def reward(text, item):
        scored.append(text)
        return float(text == item["answer"])

    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        lambda item: backend.tokenizer(item["prompt"]).input_ids,
        items=items,
        reward_fn=reward,
        client=StopAfterOneRequest(coordinator),
        writer=writer,
    )
    worker.run()
    rollouts = reader.get(max_items=100, timeout_s=1)
    assert len(rollouts) == worker.samples_generated == 12 == len(scored)
    assert worker.tokens_generated == sum(len(r.response_ids) for r in rollouts) > 12
    assert sorted({r.group_id for r in rollouts}) == ["s-g0", "s-g1", "s-g2"]
    for r in rollouts:
        assert r.group_size == 4 and r.generator_id == "gen-0" and r.versions == [0] * len(r.response_ids)
        assert r.prompt_ids == backend.tokenizer(items[r.prompt_index]["prompt"]).input_ids
        assert r.reward == float(
            backend.tokenizer.decode(r.response_ids, skip_special_tokens=True) == items[r.prompt_index]["answer"]
        )


def test_a_failing_or_slow_reward_is_marked_failed_counted_and_generation_goes_on(tmp_path):
    config = load_config(
        None, ["--generator.samples_per_prompt=4", "--generator.groups_per_request=1", "--task.reward_timeout_s=30"]
    )
    clock, release = FakeClock(), threading.Event()
    coordinator = Coordinator(StalenessBound(4, 4), PromptCursor(10, 0), group_size=4, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address="worker-rewards", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    calls = []

    def reward(text, item):
        calls.append(text)
        k = len(calls)
        if k == 2:
            raise KeyError("label")
        if k == 3:
            return float("nan")
        if k == 5:  # the second group's first sample runs out of time, alone
            clock.advance(31.0)
            release.wait()  # and never returns on its own; its thread is abandoned
        if k == 8:
            return "1.0"  # the extracted answer, not its score: float() would have taken it
        return 1.0

    backend = ScriptedBackend(coordinator, v1=None)
    backend.generate = lambda requests, params, between_steps=None: iter(
        [(r, [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(4)]) for r in requests]
    )
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1],
        items=[{"prompt": "1"}] * 10,
        reward_fn=reward,
        client=DirectClient(coordinator),
        writer=writer,
        clock=clock,
        sleep=clock.sleep,
        wait_until=waits_on(clock),
    )
    try:
        for _ in range(2):
            reply = worker.link.ask(1)
            requests = [GenerationRequest(t.group_id, [1]) for t in reply.tickets]
            for request, samples in backend.generate(requests, worker.params):
                worker.push(worker.rollouts(request, 0, samples, 0.0))
    finally:
        release.set()
    rollouts = reader.get(max_items=100, timeout_s=1)
    assert [r.reward for r in rollouts] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert [r.reward_failed for r in rollouts] == [False, True, True, False, True, False, False, True]
    failures = {"KeyError": 1, "non_finite": 1, "timeout": 1, "TypeError": 1}
    assert worker.reward_failures == failures
    worker.link.ask(0)  # the next heartbeat carries the counts to the learner
    assert coordinator.generator_list()[0].reward_failures == failures


class FullBuffer:
    """A durable buffer that stays full for ``tries`` writes, each of which takes the first rollout before it
    runs out of time; then it takes everything."""

    durable = True

    def __init__(self, tries: int) -> None:
        self.tries = tries
        self.puts: list[list[str]] = []

    def put(self, rollouts, timeout_s):
        self.puts.append([r.rollout_id for r in rollouts])
        if self.tries:
            self.tries -= 1
            raise BufferTimeout(f"the buffer stayed full for {timeout_s:g}s", sent=1)

    def close(self, linger_s=0.0):
        pass


@pytest.mark.parametrize("learner_done", [False, True])
def test_a_full_buffer_is_waited_out_for_as_long_as_the_learner_wants_the_group(learner_done, tmp_path, caplog):
    config = load_config(None, ["--generator.samples_per_prompt=3", "--buffer.timeout_s=5"])
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=3, lease_s=60, session="s")
    backend = ScriptedBackend(coordinator)
    writer = FullBuffer(tries=2)
    clock = FakeClock()
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1],
        items=[{"prompt": "1"}] * 10,
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=writer,
        clock=clock,
        sleep=clock.sleep,
    )
    [ticket] = worker.link.ask(1).tickets
    samples = [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(3)]
    rollouts = worker.rollouts(GenerationRequest(ticket.group_id, [1]), ticket.prompt_index, samples, 0.0)
    ids = [r.rollout_id for r in rollouts]
    with (tmp_path / "produced").open("w") as worker.produced_log:
        coordinator.publish(
            folders.publish(
                [("w", torch.zeros(2))],
                version=1,
                weights_dir=tmp_path,
                model_dir=ROOT / "assets/tiny-llama",
                config_json="{}",
            )
        )  # a version the learner waits for this generator to join
        if learner_done:
            coordinator.stop()
        assert worker.push(rollouts) is not learner_done
    produced = (tmp_path / "produced").read_text().split()
    if learner_done:  # the group is no longer needed: no more tries, and nothing to report
        assert writer.puts == [ids] and produced == ids[:1] and backend.loaded == []
        assert not worker.link.unreported_written
    else:  # each try sends what the one before left, and between two the pushed version is taken
        assert writer.puts == [ids, ids[1:], ids[2:]] and produced == ids and backend.loaded == [1]
        assert list(worker.link.unreported_written) == [ticket.group_id]
    warnings = [r.getMessage() for r in caplog.records if "checking on the learner" in r.getMessage()]
    assert warnings == ["gen-0: the buffer stayed full for 5s; checking on the learner"] * (1 if learner_done else 2)


def test_a_held_out_reward_that_hangs_fails_in_time_instead_of_holding_the_generator():
    clock, release = FakeClock(), threading.Event()

    def reward(text, item):
        if text == "hang":
            clock.advance(31.0)  # past task.reward_timeout_s, and it never returns on its own
            release.wait()
        return 1.0

    scorer = Scorer(reward, timeout_s=30, generator_id="gen-0", clock=clock, wait_until=waits_on(clock))
    try:
        assert scorer.reward_in_time("fine", {}) == 1.0
        with pytest.raises(TimeoutError, match="task.reward_timeout_s=30"):
            scorer.reward_in_time("hang", {})
        assert scorer.reward_in_time("fine", {}) == 1.0, "a fresh scorer thread takes over"
    finally:
        release.set()


def test_a_held_out_reward_is_checked_as_training_checks_it():
    def reward(text, item):
        return {"text": "12", "nan": float("nan")}.get(text, 1.0)

    scorer = Scorer(reward, timeout_s=30, generator_id="gen-0", clock=FakeClock())
    assert scorer.reward_in_time("fine", {}) == 1.0
    with pytest.raises(ValueError, match="str"):  # float("12") would have scored 12, a pass
        scorer.reward_in_time("text", {})
    with pytest.raises(ValueError, match="non_finite"):
        scorer.reward_in_time("nan", {})


class LengthLimitedBackend:
    """Refuses a batch holding a prompt over ``limit`` tokens as vLLM does: add_request raises ValueError before
    any step. The learner stops after ``groups`` groups."""

    def __init__(self, coordinator: Coordinator, limit: int, groups: int) -> None:
        self.coordinator, self.limit, self.groups = coordinator, limit, groups
        self.version = 0

    def generate(self, requests, params, between_steps=None):
        for request in requests:
            if len(request.prompt_ids) > self.limit:
                raise PromptRefused(
                    f"The decoder prompt (length {len(request.prompt_ids)}) is longer than the "
                    f"maximum model length of {self.limit}."
                )
        for request in requests:
            yield request, [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(params.n)]
            self.groups -= 1
            if self.groups == 0:
                self.coordinator.stop()


def test_a_prompt_the_engine_refuses_is_logged_once_and_the_generator_goes_on(caplog):
    config = load_config(None, ["--generator.samples_per_prompt=2", "--generator.groups_per_request=3"])
    coordinator = Coordinator(StalenessBound(10, 100), PromptCursor(3, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address="worker-refused", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    items = [{"prompt": "1", "row": 1}, {"prompt": "long", "row": 7}, {"prompt": "2", "row": 9}]
    worker = GeneratorWorker(
        config,
        "gen-0",
        LengthLimitedBackend(coordinator, limit=3, groups=4),
        prompt_ids=lambda item: [1] * (10 if item["prompt"] == "long" else 2),
        items=items,
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=writer,
    )
    worker.run()  # returns when the learner says stop
    rollouts = reader.get(max_items=100, timeout_s=1)
    assert {r.prompt_index for r in rollouts} == {0, 2} and len(rollouts) >= 8
    assert list(worker.link.refused_prompts) == [1] and worker.link.refused_tickets == 1
    refusals = [r.getMessage() for r in caplog.records if "refused prompt" in r.getMessage()]
    assert len(refusals) == 1 and "refused prompt 1 (row 7, 10 tokens)" in refusals[0]
    assert "longer than the maximum model length" in refusals[0]
    # The learner heard: the ticket's slots are free at once (not after ticket_timeout_s), and prompt 1 is
    # issued no more, so the second batch held prompts 0 and 2 only.
    assert coordinator.retired == {1} and coordinator.bound.dropped["prompt_refused"] == 2
    assert not worker.link.unreported_refusals


def test_built_prompts_are_kept_for_the_recent_tickets_only(monkeypatch):
    import generators.worker as worker_module

    monkeypatch.setattr(worker_module, "PROMPT_CACHE_SIZE", 4)
    coordinator = Coordinator(StalenessBound(4, 4), PromptCursor(10, 0), group_size=8, lease_s=60, session="s")
    built = []
    worker = GeneratorWorker(
        load_config(None, []),
        "gen-0",
        ScriptedBackend(coordinator),
        prompt_ids=lambda item: built.append(item["prompt"]) or [1, int(item["prompt"])],
        items=[{"prompt": str(i)} for i in range(10)],
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=open_writer(BufferConfig(type="inproc", address="worker-cache", capacity=1)),
    )
    for index in range(10):
        assert worker.prompt(index) == [1, index]
    worker.prompt(9)  # recent: kept
    worker.prompt(0)  # long gone: built again
    assert built == [str(i) for i in range(10)] + ["0"]


HUNG_REWARD = """
import threading
from asyncrl.config import BufferConfig, load_config
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.staleness import StalenessBound
from buffers import open_writer
from conftest import DirectClient
from test_generator_worker import ScriptedBackend
from generators.worker import GeneratorWorker

def reward(text, item):
    threading.Event().wait()  # a sympy call or a socket read that never returns

coordinator = Coordinator(StalenessBound(4, 4), PromptCursor(1, 0), group_size=8, lease_s=60, session="s")
worker = GeneratorWorker(load_config(None, ["--task.reward_timeout_s=0.2"]), "gen-0", ScriptedBackend(coordinator),
                         prompt_ids=lambda item: [1], items=[{"prompt": "1"}], reward_fn=reward,
                         client=DirectClient(coordinator),
                         writer=open_writer(BufferConfig(type="inproc", address="hung", capacity=1)))
try:
    worker.scorer.reward_in_time("x", {})
except TimeoutError as exc:
    print("timed out:", exc, flush=True)
"""


def test_a_hung_reward_does_not_keep_the_generator_process_from_exiting():
    # A real process, with the real clock: what is tested is that it exits with a reward thread still hung.
    out = subprocess.run(
        [sys.executable, "-c", HUNG_REWARD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "tests",
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no score within task.reward_timeout_s=0.2" in out.stdout


HUNG_READ = """
import threading, time
from generators.base import within

try:
    within(0.2, "reading weights v3", time.sleep, 3600)  # a read from a file system that stopped answering
except TimeoutError as exc:
    print(exc, "|", [t.name for t in threading.enumerate() if not t.daemon], flush=True)
"""


def test_a_weight_read_that_hangs_times_out_and_does_not_keep_the_process_from_exiting():
    # A real process, with the real clock: what is tested is that it exits with a read thread still hung.
    out = subprocess.run(
        [sys.executable, "-c", HUNG_READ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "reading weights v3: not done within 0.2s | ['MainThread']"


def test_within_passes_on_the_calls_own_timeout_and_result():
    from generators.base import within

    def refuses():
        raise TimeoutError("the weight server did not answer")

    with pytest.raises(TimeoutError, match="the weight server did not answer"):
        within(30, "fetching v2", refuses)
    assert within(30, "summing", sum, [1, 2, 3]) == 6


class SlowEngine:
    """Takes ``step_s`` on ``clock`` per engine step, ``steps`` steps per batch (an evaluation's long answers)."""

    version = 0

    def __init__(self, clock: FakeClock, steps: int, step_s: float, on_step=lambda: None) -> None:
        self.clock, self.steps, self.step_s, self.on_step = clock, steps, step_s, on_step

    def generate(self, requests, params, between_steps=None):
        for _ in range(self.steps):
            self.clock.advance(self.step_s)
            self.on_step()
            if between_steps is not None:
                between_steps()
        for request in requests:
            yield request, [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(params.n)]


class OnePiece:
    """An evaluation schedule that hands out one piece, with the first tickets."""

    def __init__(self) -> None:
        self.given = False

    def next_piece(self, version):
        if self.given:
            return None
        self.given = True
        return EvalTicket(version=0, indices=[0, 1], k=2, temperature=1.0, max_new_tokens=4)

    def report(self, report):
        pass

    def generated(self, samples, tokens):
        pass


@pytest.mark.parametrize("update_in_flight", [True, False])
def test_a_batch_longer_than_the_lease_keeps_its_tickets(update_in_flight, fake_time):
    lease_s = 30.0
    config = load_config(
        None,
        [
            "--generator.samples_per_prompt=2",
            "--generator.groups_per_request=2",
            f"--generator.update_in_flight={update_in_flight}",
            f"--coordinator.generator_lease_s={lease_s}",
        ],
    )
    coordinator = Coordinator(
        StalenessBound(4, 8), PromptCursor(10, 0), group_size=2, lease_s=lease_s, session="s", clock=fake_time
    )
    coordinator.evals = OnePiece()
    _silent_generator_takes_a_ticket(coordinator)
    buffer = BufferConfig(type="inproc", address=f"lease-{update_in_flight}", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)

    class StopAfterOneBatch(DirectClient):
        gave_tickets = False

        def call(self, request, expected):
            if isinstance(request, EvalReport):
                return Ack()
            if self.gave_tickets and request.max_groups:
                coordinator.stop()  # the ask for more tickets after the batch is told to stop
            reply = super().call(request, expected)
            self.gave_tickets |= bool(reply.tickets)
            return reply

    def another_generator_asks():  # the learner notices silent generators when any request comes in
        coordinator.handle_work(WorkRequest(generator_id="gen-1", weight_version=0, max_groups=0))

    engine = SlowEngine(fake_time, steps=18, step_s=5.0, on_step=another_generator_asks)
    worker = GeneratorWorker(
        config,
        "gen-0",
        engine,
        lambda item: [1, 2],
        items=[{"prompt": "x"}] * 10,
        reward_fn=lambda text, item: 1.0,
        client=StopAfterOneBatch(coordinator),
        writer=writer,
        eval_items=[{"prompt": "x"}] * 10,
        clock=fake_time,
        sleep=fake_time.sleep,
    )
    worker.run()  # an evaluation of 90 s, then a batch of 90 s: each three leases long
    groups = {r.group_id for r in reader.get(100, 1.0)}
    assert len(groups) == 2
    assert coordinator.bound.dropped == {"generator_lost": 2}, "the silent generator's lease ran out, not this one's"
    assert all(coordinator.complete(g) for g in groups), "every group it wrote is still awaited, none orphaned"


def test_slow_rewards_keep_the_lease_of_groups_that_finished_at_one_engine_step(fake_time):
    """A judge or sandbox reward scored back to back for a whole batch: the groups are still awaited after."""
    lease_s = 30.0
    config = load_config(
        None,
        [
            "--generator.samples_per_prompt=2",
            "--generator.groups_per_request=2",
            f"--coordinator.generator_lease_s={lease_s}",
            "--task.reward_timeout_s=60",
        ],
    )
    coordinator = Coordinator(
        StalenessBound(4, 8), PromptCursor(10, 0), group_size=2, lease_s=lease_s, session="s", clock=fake_time
    )
    _silent_generator_takes_a_ticket(coordinator)
    buffer = BufferConfig(type="inproc", address="lease-reward", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)

    class OneBatch(DirectClient):
        gave_tickets = False

        def call(self, request, expected):
            if self.gave_tickets and request.max_groups:
                coordinator.stop()  # the ask for more tickets after the batch is told to stop
            reply = super().call(request, expected)
            self.gave_tickets |= bool(reply.tickets)
            return reply

    class OneStep:  # every group finishes at the same engine step
        version = 0
        updates_mid_batch = True

        def generate(self, requests, params, between_steps=None):
            for request in requests:
                yield request, [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(params.n)]

    def judge(text, item):  # 4 x 11 s, each well within reward_timeout_s, together past the lease
        coordinator.handle_work(WorkRequest(generator_id="other", weight_version=0, max_groups=0))  # a scan
        fake_time.advance(11.0)
        return 1.0

    worker = GeneratorWorker(
        config,
        "gen-0",
        OneStep(),
        lambda item: [1, 2],
        items=[{"prompt": "x"}] * 10,
        reward_fn=judge,
        client=OneBatch(coordinator),
        writer=writer,
        clock=fake_time,
        sleep=fake_time.sleep,
        wait_until=waits_on(fake_time),
    )
    worker.run()
    coordinator.handle_work(WorkRequest(generator_id="other", weight_version=0, max_groups=0))  # a scan
    groups = {r.group_id for r in reader.get(100, 1.0)}
    assert len(groups) == 2
    assert coordinator.bound.dropped == {"generator_lost": 2}, "the silent generator's lease ran out, not this one's"
    assert all(coordinator.complete(g) for g in groups)


def test_an_unanswered_heartbeat_does_not_end_the_batch_in_hand(caplog):
    config = load_config(None, ["--coordinator.generator_lease_s=40"])
    clock = FakeClock()

    class Silent:
        address = "tcp://127.0.0.1:1"

        def call(self, request, expected):
            raise TimeoutError("no reply from the learner within 10s")

    buffer = BufferConfig(type="inproc", address="heartbeat-silent", capacity=10)
    worker = GeneratorWorker(
        config,
        "gen-0",
        SlowEngine(clock, steps=1, step_s=0.0),
        lambda item: [1, 2],
        items=[{"prompt": "x"}],
        reward_fn=lambda text, item: 1.0,
        client=Silent(),
        writer=open_writer(buffer),
        clock=clock,
    )
    worker.drain()  # a draining generator asks once, with no patience
    clock.advance(10.0)  # a quarter lease since it last asked
    worker.link.heartbeat()  # between two engine steps: the learner is slow to answer
    assert "a heartbeat to the learner went unanswered" in caplog.text


def test_the_transformers_backend_calls_back_per_token_and_its_worker_only_heartbeats_there(hf_backend, tmp_path):
    _publish(spike_state(MODEL, SEVEN), 1, tmp_path)  # every sample runs to max_new_tokens
    hf_backend.load_folder(folders.version_dir(tmp_path, 1), 1, timeout_s=60)
    calls = []
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    out = list(hf_backend.generate([GenerationRequest("g", [1, 5, 13])], params, lambda: calls.append(1)))
    assert [len(s.token_ids) for s in out[0][1]] == [5, 5]
    assert len(calls) == 5, "once per token, not per batch: a long batch renews its lease"
    assert hf_backend.updates_mid_batch is False  # so the worker passes its heartbeat, never its weight poll
    config = load_config(None, ["--generator.update_in_flight=true"])
    coordinator = Coordinator(StalenessBound(4, 8), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    polls = []

    class Recording:
        updates_mid_batch = False
        version = 0

        def generate(self, requests, params, between_steps=None):
            polls.append(between_steps)
            coordinator.stop()
            yield from ()

    worker = GeneratorWorker(
        config,
        "gen-0",
        Recording(),
        lambda item: [1, 2],
        items=[{"prompt": "x"}] * 10,
        reward_fn=lambda text, item: 1.0,
        client=DirectClient(coordinator),
        writer=open_writer(BufferConfig(type="inproc", address="hf-poll", capacity=100)),
    )
    worker.run()
    assert polls == [worker.link.heartbeat]
