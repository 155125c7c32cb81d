"""The interface every generation backend implements.

It is shaped for continuous batching: :meth:`GeneratorBackend.generate`
takes many requests and yields each one's ``n`` samples as soon as they are
done, in any order, and a weight update (:meth:`GeneratorBackend.load_folder`,
:meth:`GeneratorBackend.receive_push`) may be called
between two yields. A backend that can switch weights under requests in
flight does so and stamps every token with the version that produced it; one
that cannot (the transformers backend) finishes its batch first.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from asyncrl.wire.protocol import SharedHandle

T = TypeVar("T")


class Abandoned(TimeoutError):
    """A call's time ran out: it was left running in its daemon thread, which takes no more calls."""


class DaemonRunner:
    """Runs calls one after another in a daemon thread.

    A daemon, unlike a ThreadPoolExecutor's thread (which the interpreter
    joins at exit): a call that never returns (a reward stuck in sympy, a
    read from a hung file system) cannot keep the process from exiting once
    it is done. ``clock`` measures the time limits; ``wait_until(future, until)``
    blocks until the call is done or ``clock()`` reads ``until``, so a test
    that moves a fake clock also decides when a call runs out of time.
    """

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        wait_until: Callable[[concurrent.futures.Future, float], object] | None = None,
    ) -> None:
        self._clock = clock
        self._wait_until = wait_until or self._wait_in_real_time
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (work := self._calls.get()) is not None:
            call, future = work
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001  (handed to the caller, who decides)
                future.set_exception(exc)

    def _wait_in_real_time(self, future: concurrent.futures.Future, until: float) -> None:
        concurrent.futures.wait([future], timeout=max(0.0, until - self._clock()))

    def call(
        self,
        fn: Callable[[], T],
        timeout_s: float,
        while_waiting: Callable[[], None] | None = None,
        every_s: float = 1.0,
    ) -> T:
        """``fn()``'s result, or what it raised (its own TimeoutError included); :class:`Abandoned` when
        ``timeout_s`` runs out first, after which this runner takes no more calls.

        ``while_waiting`` is called every ``every_s`` until then (a generator's heartbeat).
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        deadline = self._clock() + timeout_s  # before the call can start: its time counts from here
        self._calls.put((fn, future))
        while True:
            self._wait_until(future, min(deadline, self._clock() + every_s) if while_waiting else deadline)
            if future.done():
                return future.result()
            if while_waiting is None or self._clock() >= deadline:
                break
            while_waiting()
        self.close()
        raise Abandoned(f"not done within {timeout_s:g}s") from None

    def close(self) -> None:
        """Let the thread end once its call in hand returns, if ever; no new call goes to it."""
        self._calls.put(None)


def within(timeout_s: float, what: str, fn: Callable[..., T], *args) -> T:
    """Run ``fn(*args)`` in a daemon thread and give up after ``timeout_s``.

    Used for the slow, fallible I/O of a weight update (reading, checking,
    staging), which runs before anything in the serving model changes; on a
    timeout the thread is abandoned, not waited for, not even at exit.
    """
    runner = DaemonRunner(what)
    try:
        return runner.call(lambda: fn(*args), timeout_s)
    except Abandoned as exc:
        raise TimeoutError(f"{what}: {exc}") from None
    finally:
        runner.close()


class PromptRefused(ValueError):
    """The engine will not take a request (a prompt that fills its ``max_model_len``), raised as it is added,
    before any sampling: that prompt fails, not the engine."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the same fields as the ``generator`` config section."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()


def sampling_params(gen: Any) -> SamplingParams:
    """The ``generator`` config section's sampling settings."""
    return SamplingParams(
        n=gen.samples_per_prompt,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        stop=tuple(gen.stop),
    )


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to sample ``n`` responses for; ``request_id`` is the group id."""

    request_id: str
    prompt_ids: list[int]


@dataclass
class Sample:
    """One response: tokens, behaviour log-probs and the version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    text: str = ""


class GeneratorBackend(Protocol):
    """A policy that samples responses and takes versioned weight updates."""

    version: int
    # Whether a weight update may land between two engine steps of a batch (each token then carries the
    # version that sampled it); where not, ``between_steps`` must not load weights.
    updates_mid_batch: bool

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        """Yield ``(request, samples)`` for every request as it completes.

        ``between_steps`` is called after every engine step (a heartbeat to
        the learner; with :attr:`updates_mid_batch`, the caller may also call
        :meth:`load_folder` or :meth:`receive_push` from it).
        """
        ...

    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        """Switch to the HF folder of ``version`` entirely, or raise and keep serving the old one."""
        ...

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        """Join push ``epoch`` and switch to what arrives entirely, or raise and keep serving the old one.

        What arrives is checked whole before any of it is loaded. Should the engine's own loader still fail
        part-way (a pushed or shared version has no folder to go back to), the engine reloads the last
        folder it loaded, sets ``version`` to that folder's and says so in the error; the learner pushes
        its latest version again to a generator that lags.
        """
        ...

    def load_shared(self, handle: SharedHandle, version: int, timeout_s: float) -> None:
        """Copy ``version`` out of the learner's shared-memory segment and switch to it entirely, or raise
        (:class:`asyncrl.weights.shared.Superseded` when the learner has already moved on) and keep serving."""
        ...

    def close(self) -> None: ...


class Stepwise(Protocol):
    """What :class:`RequestStream` drives: an engine's requests, added, stepped and aborted one by one."""

    version: int

    def sampling(self, params: SamplingParams) -> Any: ...
    def add(self, prompt_ids: Sequence[int], sampling: Any) -> str: ...
    def step(self) -> list[Any]: ...
    def sample(self, completion: Any, started_version: int) -> Sample: ...
    def abort(self, request_ids: list[str]) -> None: ...


def is_stepwise(backend: object) -> bool:
    """Whether ``backend`` takes requests one by one while others run (:class:`Stepwise`)."""
    return all(callable(getattr(backend, name, None)) for name in ("sampling", "add", "step", "sample", "abort"))


@dataclass
class InFlight:
    """A request in a :class:`RequestStream`: what it asked for, the version it started on, and the caller's tag."""

    request: GenerationRequest
    n: int
    started_version: int
    tag: Any = None


class RequestStream:
    """Requests in flight on a :class:`Stepwise` engine, added at any time, each with its own sampling: a
    request comes back from :meth:`step` with its ``n`` samples as soon as they are all done.

    What keeps an engine at its ceiling: the caller adds work whenever it has some (a generator, new tickets
    while others run), instead of waiting for a batch's slowest request.
    """

    def __init__(self, engine: Stepwise) -> None:
        self.engine = engine
        self._pending: dict[str, InFlight] = {}  # by the engine's request id
        self._sampling: dict[SamplingParams, Any] = {}
        self.samples = 0  # samples in flight

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: GenerationRequest, params: SamplingParams, tag: Any = None) -> None:
        """Put ``request`` in flight; :class:`PromptRefused` when the engine will not take it."""
        key = replace(params, stop=tuple(params.stop))  # hashable
        if key not in self._sampling:
            self._sampling[key] = self.engine.sampling(params)
        engine_id = self.engine.add(request.prompt_ids, self._sampling[key])
        self._pending[engine_id] = InFlight(request, params.n, self.engine.version, tag)
        self.samples += params.n

    def step(self) -> list[tuple[InFlight, list[Sample]]]:
        """One engine step: every request it finished, with its samples in order."""
        done = []
        for output in self.engine.step():
            entry = self._pending.pop(output.request_id, None)
            if entry is None:  # aborted meanwhile
                continue
            self.samples -= entry.n
            completions = sorted(output.outputs, key=lambda c: c.index)
            done.append((entry, [self.engine.sample(c, entry.started_version) for c in completions]))
        return done

    def abort(self) -> None:
        """Free the engine of every request still in flight."""
        if self._pending:
            self.engine.abort(list(self._pending))
            self._pending.clear()
            self.samples = 0


def generate_stepwise(
    engine: Stepwise,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    between_steps: Callable[[], None] | None = None,
) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
    """Put every request in flight on ``engine`` and yield each group as soon as its ``n`` samples finish;
    ``between_steps`` runs after every step, where an update may land."""
    stream = RequestStream(engine)
    try:
        for request in requests:  # one the engine refuses (a prompt too long) raises: the others are aborted
            stream.add(request, params)
        while stream:
            for entry, samples in stream.step():
                yield entry.request, samples
            if between_steps is not None and stream:
                between_steps()
    finally:
        stream.abort()  # the caller stopped early, or the engine refused a request
