"""A generator that keeps its engine full: tickets asked for while groups run, each group sent the moment it is
done, and held-out evaluation answered beside the training work in the same engine, on one version."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, DirectClient, FakeClock

from asyncrl.config import EvalConfig, load_config
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.evaluation import EvalBook
from asyncrl.control.staleness import StalenessBound
from asyncrl.weights import folders
from asyncrl.wire.protocol import Ack, EvalReport, WorkRequest
from generators import streaming
from generators.base import Sample
from generators.worker import GeneratorWorker

GROUP = 2  # samples per prompt


class StepEngine:
    """A stepwise engine whose request for prompt ``[i, ...]`` finishes ``2 + i % 3`` steps after it went in.

    It keeps, per step, which requests were running (training or evaluation, by the sampling they asked for),
    and runs ``at_step[k]()`` after step ``k``.
    """

    updates_mid_batch = True

    def __init__(self) -> None:
        self.version = 0
        self.ids = itertools.count()
        self.running: dict[str, dict] = {}
        self.steps = 0
        self.log: list[dict] = []  # per step: {"training": n, "eval": n, "version": v}
        self.finished_at: dict[str, int] = {}  # engine id -> the step it finished at
        self.loaded: list[tuple[int, int]] = []  # (version, after step)
        self.at_step: dict[int, callable] = {}

    def sampling(self, params):
        return params

    def add(self, prompt_ids, sampling):
        engine_id = f"r{next(self.ids)}"
        steps = 2 + prompt_ids[0] % 3
        self.running[engine_id] = {
            "left": steps,
            "n": sampling.n,
            "eval": sampling.temperature != 1.0 or sampling.n != GROUP,
        }
        return engine_id

    def step(self):
        self.steps += 1
        evals = sum(r["eval"] for r in self.running.values())
        self.log.append({"training": len(self.running) - evals, "eval": evals, "version": self.version})
        done = []
        for engine_id, request in list(self.running.items()):
            request["left"] -= 1
            if request["left"] == 0:
                del self.running[engine_id]
                self.finished_at[engine_id] = self.steps
                outputs = [SimpleNamespace(index=i, version=self.version) for i in range(request["n"])]
                done.append(SimpleNamespace(request_id=engine_id, outputs=outputs))
        if self.steps in self.at_step:
            self.at_step.pop(self.steps)()
        return done

    def sample(self, completion, started_version):
        return Sample([5, 2], [-0.1, -0.2], [completion.version] * 2, "stop", "3")

    def abort(self, request_ids):
        for engine_id in request_ids:
            self.running.pop(engine_id, None)

    def load_folder(self, folder, version, timeout_s):
        self.loaded.append((version, self.steps))
        self.version = version


class Client(DirectClient):
    """The coordinator in process, evaluation reports included."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator, self.address, self.reports = coordinator, "inproc", []
        self.waits: list[bool] = []  # per request for tickets: whether it was a long poll
        self.stop_after_long_polls = 3  # the learner ends the run once the generator is idle

    def call(self, request, expected):
        if isinstance(request, EvalReport):
            self.reports.append(request)
            self.coordinator.evals.report(request)
            return Ack()
        if request.max_groups:
            self.waits.append(request.wait_s > 0)
            if self.waits.count(True) > self.stop_after_long_polls:
                self.coordinator.stop()
        return self.coordinator.handle_work(request)


class Writer:
    """A buffer that notes the engine step at which each group arrived."""

    durable = False

    def __init__(self, engine: StepEngine) -> None:
        self.engine, self.puts = engine, []

    def put(self, rollouts, timeout_s):
        self.puts.append((rollouts[0].group_id, self.engine.steps, [r.versions for r in rollouts]))

    def close(self, linger_s=0.0):
        pass


def start(*overrides: str, bound: int = 12, evals: EvalBook | None = None):
    """A worker on a StepEngine; the learner admits ``bound`` groups and says stop once the generator idles."""
    config = load_config(
        None,
        [
            f"--generator.samples_per_prompt={GROUP}",
            "--generator.groups_per_request=2",
            "--generator.update_poll_s=0",
            "--generator.max_new_tokens=4",
            *overrides,
        ],
    )
    clock = FakeClock()
    coordinator = Coordinator(
        StalenessBound(0, bound * GROUP), PromptCursor(30, 0), group_size=GROUP, lease_s=60, session="s", clock=clock
    )
    coordinator.evals = evals
    engine = StepEngine()
    client = Client(coordinator)
    writer = Writer(engine)
    items = [{"prompt": str(i), "label": "3"} for i in range(30)]
    worker = GeneratorWorker(
        config,
        "gen-0",
        engine,
        prompt_ids=lambda item: [int(item["prompt"]), 7],
        items=items,
        reward_fn=lambda text, item: 1.0,
        client=client,
        writer=writer,
        eval_items=[{"prompt": str(i), "label": "3"} for i in range(4)],
        clock=clock,
        sleep=clock.advance,
    )
    assert worker.streams
    return worker, engine, coordinator, client, writer


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(streaming, "engine_on_gpu", lambda: True)


def test_the_engine_holds_as_many_groups_as_the_staleness_bound_admits_not_one_request_at_a_time(on_gpu):
    worker, engine, _, _, writer = start(bound=12)
    worker.run()
    assert max(step["training"] for step in engine.log) == 12  # a request asks for 2
    assert len(writer.puts) == 12


def test_on_a_cpu_the_engine_holds_a_requests_worth_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(streaming, "engine_on_gpu", lambda: False)
    worker, engine, _, _, writer = start(bound=12)
    worker.run()
    assert max(step["training"] for step in engine.log) == 2  # generator.groups_per_request
    assert len(writer.puts) == 12


def test_max_groups_in_flight_caps_what_the_engine_holds(on_gpu):
    worker, engine, _, _, writer = start("--generator.max_groups_in_flight=4", bound=12)
    worker.run()
    assert max(step["training"] for step in engine.log) == 4
    assert len(writer.puts) == 12  # the rest went in as groups finished


def test_each_group_is_written_at_the_step_it_finishes_not_with_its_batch(on_gpu):
    worker, engine, _, _, writer = start(bound=12)
    worker.run()
    finished = sorted(engine.finished_at.values())
    assert [step for _, step, _ in writer.puts] == finished
    assert len(set(finished)) > 1, "groups of one request finished at different steps"


def test_an_evaluation_runs_beside_training_on_one_version_and_new_weights_wait_for_it(tmp_path, on_gpu):
    clock = FakeClock()
    book = EvalBook(
        EvalConfig(every_steps=1, k=3, items_per_request=4), num_items=4, max_new_tokens=4, threshold=1.0, clock=clock
    )
    book.schedule(version=0, step=0)
    worker, engine, coordinator, client, writer = start(bound=12, evals=book)
    v1 = folders.publish(
        [("w", torch.zeros(2))], version=1, weights_dir=tmp_path, model_dir=ROOT / "assets/tiny-llama", config_json="{}"
    )
    engine.at_step[1] = lambda: coordinator.publish(v1)  # announced while the evaluation is in flight
    worker.run()

    [report] = client.reports
    assert len(report.traces) == 4 * (1 + 3)  # greedy and k=3 for each of 4 prompts
    assert {t.version for t in report.traces} == {0}
    assert {t.tokens for t in report.traces} == {2}, "each answer's tokens, what eval.max_share charges"
    beside = [s for s in engine.log if s["eval"] and s["training"]]
    assert beside, "evaluation requests ran in the same engine steps as training requests"
    last_eval_step = max(i + 1 for i, s in enumerate(engine.log) if s["eval"])
    [(version, loaded_after)] = engine.loaded
    assert version == 1 and loaded_after >= last_eval_step
    assert any(versions[0][0] == 1 for _, _, versions in writer.puts), "training went on with v1"


def test_an_idle_generator_long_polls_the_learner_and_a_busy_one_never_waits_on_it():
    worker, engine, coordinator, client, writer = start(bound=4)
    worker.run()
    assert len(writer.puts) == 4
    first_idle = client.waits.index(True, 1)  # the first ask of all is made idle too
    assert not any(client.waits[1:first_idle]), "asks with groups in flight do not wait"
    assert all(client.waits[first_idle:]), "with nothing in flight, it waits for work"


def test_under_an_evaluation_budget_the_learner_hands_out_pieces_as_training_earns_them():
    """eval.max_share 0.2: each training token a generator reports earns a quarter of an evaluation token. A
    generator asks for a group (2 answers of 10 tokens) at a time and reports what it generated with its next
    ask. Pieces of one prompt, greedy and k=3, are charged 4 answers at training's mean length (40 tokens):
    the first goes with the first ask after tokens were reported (overdrawing), then one every 8 asks; without
    a budget, one a reply from the first."""
    with_piece, shares = {}, {}
    for share in (0.0, 0.2):
        book = EvalBook(EvalConfig(every_steps=1, k=3, items_per_request=1, max_share=share), 4, 4, threshold=1.0)
        book.schedule(version=0, step=0)
        coordinator = Coordinator(
            StalenessBound(10, 100 * GROUP), PromptCursor(30, 0), group_size=GROUP, lease_s=60, session="s"
        )
        coordinator.evals = book
        asks = [
            WorkRequest("g", weight_version=0, max_groups=1, samples_generated=GROUP * i, tokens_generated=20 * i)
            for i in range(24)
        ]
        replies = [coordinator.handle_work(ask) for ask in asks]
        assert all(len(r.tickets) == 1 for r in replies)
        with_piece[share] = [i for i, r in enumerate(replies) if r.eval is not None]
        shares[share] = (book.share(), book.token_share())
    assert with_piece[0.0] == [0, 1, 2, 3]
    assert with_piece[0.2] == [1, 9, 17]
    # summary.json's eval.sequence_share and eval.token_share: the pieces' answers were never reported, so
    # evaluation generated no tokens yet as far as the book knows
    assert shares == {0.0: (16 / (46 + 16), 0.0), 0.2: (12 / (46 + 12), 0.0)}


def test_a_new_version_is_asked_for_its_work_at_once_while_the_engine_is_busy(tmp_path, on_gpu):
    """On-policy, the bound admits 4 groups a version. v1 is published while v0's 4 groups run: the generator
    hears of it at the next engine step, loads it and asks for v1's groups at once, not after ASK_AGAIN_S (the
    fake clock stands still while the engine works, so only the new version can bring that ask about)."""
    worker, engine, coordinator, _, writer = start(bound=4)
    v1 = folders.publish(
        [("w", torch.zeros(2))], version=1, weights_dir=tmp_path, model_dir=ROOT / "assets/tiny-llama", config_json="{}"
    )
    engine.at_step[1] = lambda: coordinator.publish(v1)
    worker.run()
    assert engine.loaded == [(1, 2)]  # the step after its publication
    assert engine.log[2]["training"] > 4, "v1's groups went in beside v0's last ones"
    assert len(writer.puts) == 8
