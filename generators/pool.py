"""Several LoRA runs, one generator process and one vLLM engine: ``asyncrl-generator A.yaml B.yaml``.

Each run keeps everything that makes it a run: its coordinator (tickets, the
staleness bound, evaluation), its buffer, its task and reward, its adapter and
its versions, all in a :class:`~generators.worker.GeneratorWorker` of its own,
on a thread of its own: the same worker a generator of one run has. What the
runs share is the engine: one base model with one adapter slot per run.

One thread steps the engine (:class:`SharedEngine`); each run's worker drives
a :class:`Lane`, its view of the engine. A lane's requests go with its run's
adapter, come back to that lane alone (by request id), and a new version of a
run swaps that run's slot only, between two engine steps. So requests of all
runs are batched together, and a rollout never reaches another run.

The tokens of a request are labelled with the version of its own run's adapter
that sampled them: the engine labels tokens with a count of adapter swaps (any
run's), and each lane maps a count to its own version at that point.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.wire.protocol import SharedHandle
from generators.base import GenerationRequest, Sample, SamplingParams, generate_stepwise

log = logging.getLogger(__name__)

# How long a lane waits for one of its requests to finish before it returns to its worker (which heartbeats and
# polls for new versions between steps); the engine thread steps meanwhile.
STEP_WAIT_S = 0.05
# How long an asker waits for the engine's lock before saying so in the log (and waiting on).
TURN_WARN_S = 60.0


class Turns:
    """The engine's lock, taken in the order it was asked for: by the engine thread for each step, by a lane
    for each call (an add, an abort, an adapter swap).

    A plain lock is not fair: the engine thread, stepping in a loop, asks for
    it again the moment it lets go and mostly gets it back before a waiting
    lane wakes, so runs could add requests or swap adapters only when the
    engine ran dry (a whole staleness window at a time); a lane adding request
    after request can shut the engine out the same way. Here each asker takes
    a ticket and waits for its turn: a lane's call waits for the step under
    way and the calls asked for before it, and the engine's next step for the
    calls asked for before it. A turn held for longer than ``TURN_WARN_S``
    (a step compiling kernels, a lane that hangs) is logged while others wait.
    """

    def __init__(self) -> None:
        self._next = 0  # the ticket the next asker takes
        self._serving = 0  # the ticket whose turn it is
        self._changed = threading.Condition()
        self._given_up: set[int] = set()  # tickets of askers that stopped waiting (an exception in the wait)

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._changed:
            mine = self._next
            self._next += 1
            try:
                while not self._changed.wait_for(lambda: self._serving == mine, timeout=TURN_WARN_S):
                    log.warning("shared engine: waited %.0f s for a turn, %d ahead", TURN_WARN_S, mine - self._serving)
            except BaseException:
                if self._serving == mine:
                    self._next_turn()
                else:  # skipped when its turn comes
                    self._given_up.add(mine)
                raise
        try:
            yield
        finally:
            with self._changed:
                self._next_turn()

    def _next_turn(self) -> None:
        """The next ticket's turn (held: ``_changed``)."""
        self._serving += 1
        while self._serving in self._given_up:
            self._given_up.discard(self._serving)
            self._serving += 1
        self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Askers that have not had their turn yet, or hold it."""
        return self._next - self._serving


class SharedEngine:
    """A vLLM backend stepped by one thread for several :class:`Lane`: what a lane adds comes back to it alone.

    Every call into the engine (add, abort, an adapter swap, a step) holds
    ``turns`` (:class:`Turns`), in the order asked: a lane's call waits for
    the step under way and the calls ahead of it, not for the engine to run dry.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.turns = Turns()
        self.swaps = 0  # adapter swaps in the engine, any run's: the label on the tokens sampled since
        self.error: BaseException | None = None  # what ended the engine thread, raised in every lane
        self._owner: dict[str, Lane] = {}
        self._work = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def add(self, lane: Lane, prompt_ids: Sequence[int], sampling: Any) -> str:
        self.check()
        with self.turns.turn():
            request_id = self.backend.add(prompt_ids, sampling, adapter=lane.slot.request, salt=lane.salt)
            self._owner[request_id] = lane
        self._work.set()
        return request_id

    def abort(self, request_ids: list[str]) -> None:
        with self.turns.turn():
            self.backend.abort(request_ids)
            for request_id in request_ids:
                self._owner.pop(request_id, None)

    def swap(self, lane: Lane, folder: Path, version: int, timeout_s: float) -> int:
        """Load ``lane``'s adapter of ``version`` into its slot; the label its tokens carry from now on."""
        self.check()
        staged = lane.slot.prepare(folder, version, timeout_s, self.backend.stage)  # off the engine's lock
        return self.swap_staged(lane, staged, version)

    def swap_staged(self, lane: Lane, staged: Path, version: int) -> int:
        """:meth:`swap` for an adapter folder checked and staged already (one received as tensors)."""
        self.check()
        with self.turns.turn():
            lane.slot.swap_in(staged, version)
            self.swaps += 1
            self.backend.relabel(self.swaps)
            return self.swaps

    def check(self) -> None:
        """Raise what stopped the engine thread, if anything did."""
        if self.error is not None:
            raise RuntimeError(f"the shared engine stopped: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while not self._closed:
                if not self._owner:
                    self._work.wait(STEP_WAIT_S)
                    self._work.clear()
                    continue
                with self.turns.turn():
                    finished = [(self._owner.pop(out.request_id, None), out) for out in self.backend.step()]
                for lane, output in finished:
                    if lane is not None:  # else aborted by its lane meanwhile
                        lane.done.put(output)
        except BaseException as exc:  # noqa: BLE001  (every lane raises it at its next call)
            log.exception("the shared engine stopped")
            self.error = exc

    def close(self) -> None:
        self._closed = True
        self._work.set()
        self._thread.join(timeout=10)
        self.backend.close()


class Lane:
    """One run's view of a :class:`SharedEngine`: the backend its worker drives, with the run's adapter slot
    (:class:`generators.vllm_adapters.AdapterSlot`), versions, and ``wire`` for its pushed or shared ones
    (:class:`generators.vllm_adapters.AdapterWire`)."""

    updates_mid_batch = True

    def __init__(self, engine: SharedEngine, slot: Any, wire: Any = None) -> None:
        self.engine, self.slot, self.wire = engine, slot, wire
        self.tokenizer = engine.backend.tokenizer
        self.done: queue.Queue = queue.Queue()  # this lane's finished requests, put there by the engine thread
        self._labels, self._versions = [0], [0]  # from engine label _labels[i] on, this run's _versions[i]

    @property
    def version(self) -> int:
        """The version of this run's adapter in its slot."""
        return self._versions[-1]

    @property
    def salt(self) -> str:
        """What salts this lane's prefix-cache keys: its run and its count of adapter loads (KV computed with
        another run's adapter, or an older one, never serves its requests)."""
        return f"asyncrl-{self.slot.name}-{len(self._labels)}"

    def sampling(self, params: SamplingParams) -> Any:
        return self.engine.backend.sampling(params)

    def add(self, prompt_ids: Sequence[int], sampling: Any) -> str:
        return self.engine.add(self, prompt_ids, sampling)

    def step(self) -> list[Any]:
        """This lane's requests that finished since the last call; waits up to :data:`STEP_WAIT_S` for one."""
        try:
            finished = [self.done.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            self.engine.check()
            return []
        while True:
            try:
                finished.append(self.done.get_nowait())
            except queue.Empty:
                return finished

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    def sample(self, completion: Any, started_version: int) -> Sample:
        return self.engine.backend.sample(completion, started_version, version_of=self.version_at)

    def version_at(self, label: int) -> int:
        """This run's version when the engine's label was ``label``."""
        return self._versions[bisect.bisect_right(self._labels, label) - 1]

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        return generate_stepwise(self, requests, params, between_steps)

    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        self._swapped(self.engine.swap(self, folder, version, timeout_s), version)

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        tensors, version = self.wire.pushed(epoch, version)
        self._swapped(self.engine.swap_staged(self, self.slot.stage_tensors(tensors, version), version), version)

    def load_shared(self, handle: SharedHandle, version: int, timeout_s: float) -> None:
        tensors = self.wire.shared(handle, version, timeout_s)
        self._swapped(self.engine.swap_staged(self, self.slot.stage_tensors(tensors, version), version), version)

    def _swapped(self, label: int, version: int) -> None:
        """The engine's tokens labelled ``label`` on are this run's ``version``."""
        self._labels.append(label)
        self._versions.append(version)

    def close(self) -> None:
        self.slot.close()


def open_pool(configs: Sequence[RunConfig]) -> tuple[SharedEngine, list[Lane]]:
    """The shared engine (the first run's engine settings, a slot per run) and one lane per run."""
    from generators import set_gc_thresholds, vllm_engine_args
    from generators.vllm_adapters import AdapterSlot, AdapterWire, engine_args, engine_device
    from generators.vllm_backend import VllmBackend

    first = configs[0]
    backend = VllmBackend(
        first.model.path,
        seed=first.generator.seed,
        **vllm_engine_args(first),
        **engine_args(*(config.learner.lora for config in configs)),
    )
    set_gc_thresholds(first.generator.gc_thresholds)
    engine = SharedEngine(backend)
    lanes = [
        Lane(
            engine,
            AdapterSlot(backend.llm, config.learner.lora, config.model.path, None, config.name, i + 1),
            AdapterWire(config.push, config.generator.push_rank, engine_device()),
        )
        for i, config in enumerate(configs)
    ]
    return engine, lanes
