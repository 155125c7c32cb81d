"""Turns for multi-turn episodes: one request per model turn, added while others are in flight.

An episode's next turn can start only once its environment has answered the
last one, so turns arrive one by one, not in batches. :class:`VllmTurns`
adds each to the running vLLM engine at once (continuous batching: while one
episode waits on its tool, the engine samples the others); :class:`BatchTurns`
serves any other backend by sampling whatever turns are waiting as one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from generators.base import GenerationRequest, GeneratorBackend, Sample, SamplingParams


class TurnEngine(Protocol):
    """Turns in, finished samples out, keyed by the caller's key."""

    # Whether a turn added joins the ones in flight at the next step (vLLM), or the engine samples a batch to
    # its end per step (then the caller gathers turns before stepping).
    continuous: bool

    def add(self, key: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Start sampling one turn (``params.n`` is taken as 1); raises :class:`PromptRefused` for a prompt the
        engine will not take."""
        ...

    def step(self, between_steps: Callable[[], None]) -> list[tuple[str, Sample]]:
        """Sample on; the turns that finished, which may be none. ``between_steps`` runs where an update may
        land (and serves as the heartbeat)."""
        ...

    def abort(self, keys: list[str]) -> None: ...

    @property
    def busy(self) -> bool:
        """Whether any turn is in flight."""
        ...


class VllmTurns:
    """Turns as requests of the running vLLM engine, one engine step per :meth:`step`."""

    continuous = True

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._keys: dict[str, tuple[str, int]] = {}  # engine id -> (key, version at start)
        self._ids: dict[str, str] = {}  # key -> engine id
        self._sampling: dict[tuple[int, float, tuple[str, ...]], Any] = {}  # by what tells one turn's sampling

    def add(self, key: str, prompt_ids: list[int], params: SamplingParams) -> None:
        cached = (params.max_new_tokens, params.temperature, tuple(params.stop))  # evaluation's stop may differ
        if cached not in self._sampling:
            self._sampling[cached] = self.backend.sampling(replace(params, n=1))
        request_id = self.backend.add(prompt_ids, self._sampling[cached])
        self._keys[request_id] = (key, self.backend.version)
        self._ids[key] = request_id

    def step(self, between_steps: Callable[[], None]) -> list[tuple[str, Sample]]:
        done = []
        for output in self.backend.step():
            if output.request_id in self._keys:
                key, started = self._keys.pop(output.request_id)
                del self._ids[key]
                done.append((key, self.backend.sample(output.outputs[0], started)))
        between_steps()
        return done

    def abort(self, keys: list[str]) -> None:
        ids = [self._ids.pop(key) for key in keys if key in self._ids]
        for request_id in ids:
            del self._keys[request_id]
        if ids:
            self.backend.abort(ids)

    @property
    def busy(self) -> bool:
        return bool(self._keys)


class BatchTurns:
    """Any backend: the turns waiting when :meth:`step` is called are sampled together, to the end."""

    continuous = False

    def __init__(self, backend: GeneratorBackend) -> None:
        self.backend = backend
        self._waiting: dict[str, tuple[list[int], SamplingParams]] = {}

    def add(self, key: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._waiting[key] = (prompt_ids, replace(params, n=1))

    def step(self, between_steps: Callable[[], None]) -> list[tuple[str, Sample]]:
        by_params: dict[SamplingParams, list[GenerationRequest]] = {}
        for key, (prompt_ids, params) in self._waiting.items():
            by_params.setdefault(params, []).append(GenerationRequest(key, prompt_ids))
        self._waiting.clear()
        done = []
        for params, requests in by_params.items():
            for request, samples in self.backend.generate(requests, params, between_steps):
                done.append((request.request_id, samples[0]))
        return done

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            self._waiting.pop(key, None)

    @property
    def busy(self) -> bool:
        return bool(self._waiting)


def turn_engine(backend: GeneratorBackend) -> TurnEngine:
    """The way to run turns on ``backend``: one at a time into a running engine that takes requests in flight
    (vLLM's: ``add``, ``step``, ``sample``, ``abort``), else in batches."""
    if all(callable(getattr(backend, name, None)) for name in ("add", "step", "sample", "abort", "sampling")):
        return VllmTurns(backend)
    return BatchTurns(backend)
