"""The generators a coordinator hears from: what each reported, its lease, and which process holds its id.

Every request a generator sends is a heartbeat: its lease runs
``generator_lease_s`` from the last one. A generator restarted under its id
sends another ``incarnation``; from then on a request from the earlier process
is refused, since two live processes under one id would take each other's
tickets back at every request.
"""

from __future__ import annotations

from asyncrl.wire.protocol import GeneratorStatus, WorkRequest, now_s


class Roster:
    """What is known of each live generator, and whose lease ran out.

    Times passed in as ``now`` come from the coordinator's clock; the time of
    day is used only for the ``last_seen_s`` that ``asyncrl status`` shows. Not
    locked on its own: the coordinator calls it under its lock.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.status: dict[str, GeneratorStatus] = {}  # generator id -> what its last request reported
        self.told_to_stop: set[str] = set()
        self._seen: dict[str, float] = {}  # generator id -> clock time of its last request: its lease runs from there
        self._replaced: dict[str, set[str]] = {}  # generator id -> incarnations a later start under it replaced
        self._left: set[tuple[str, str]] = set()  # (id, incarnation) of processes that said goodbye
        # Samples every generator process reported, in all: a generator forgotten (silent, left) or restarted keeps
        # what it counted. By (id, incarnation): the samples and tokens each process last reported.
        self.samples_generated = 0
        self._reported: dict[tuple[str, str], tuple[int, int]] = {}
        # Samples and their response tokens generated since this roster first heard each process (what evaluation's
        # budget is earned from): a generator that outlived the learner's restart brings its whole count with its
        # first request, which is generation from before this roster, and left out here.
        self.since_heard = (0, 0)

    def replaced(self, request: WorkRequest) -> bool:
        """Whether ``request`` comes from an earlier process under an id a later start has taken over."""
        return bool(request.incarnation) and request.incarnation in self._replaced.get(request.generator_id, ())

    def leaving(self, request: WorkRequest) -> None:
        """Note a drained process's goodbye, so that a request it sent before (its version watch, still held)
        does not bring it back."""
        self._left.add((request.generator_id, request.incarnation))

    def has_left(self, request: WorkRequest) -> bool:
        """Whether ``request`` comes from a process that said goodbye."""
        return (request.generator_id, request.incarnation) in self._left

    def heard(self, request: WorkRequest, now: float) -> bool:
        """Renew the lease of ``request``'s generator and keep what it reported.

        True when it is a new process under a known id (another
        ``incarnation``): what the earlier process held will never arrive.
        """
        previous = self.status.get(request.generator_id)
        restarted = previous is not None and bool(previous.incarnation) and request.incarnation != previous.incarnation
        if restarted:
            self._replaced.setdefault(request.generator_id, set()).add(previous.incarnation)
        self.status[request.generator_id] = GeneratorStatus(
            generator_id=request.generator_id,
            weight_version=request.weight_version,
            weight_session=request.weight_session,
            samples_generated=request.samples_generated,
            busy_s=request.busy_s,
            last_seen_s=now_s(),
            reward_failures=request.reward_failures,
            incarnation=request.incarnation,
        )
        self._seen[request.generator_id] = now
        self.count(request)
        return restarted

    def count(self, request: WorkRequest) -> None:
        """Keep what ``request``'s process reports having generated in all (a draining generator's goodbye too,
        which renews no lease)."""
        process = (request.generator_id, request.incarnation)
        known = self._reported.get(process)
        samples, tokens = known or (0, 0)
        new_samples = max(0, request.samples_generated - samples)
        self.samples_generated += new_samples
        if known is not None:
            new_tokens = max(0, request.tokens_generated - tokens)
            self.since_heard = (self.since_heard[0] + new_samples, self.since_heard[1] + new_tokens)
        self._reported[process] = (max(request.samples_generated, samples), max(request.tokens_generated, tokens))

    def expect(self, generator_id: str, now: float, incarnation: str = "") -> None:
        """Give a generator known only from a checkpoint (it holds tickets) a fresh lease, unless it was heard.

        ``incarnation``: the process that held its tickets at the checkpoint; another that asks under its id
        is a restart (what the first held will never arrive), as it is while the learner runs.
        """
        if generator_id not in self.status:
            self.status[generator_id] = GeneratorStatus(
                generator_id=generator_id,
                weight_version=-1,
                samples_generated=0,
                busy_s=0.0,
                last_seen_s=now_s(),
                incarnation=incarnation,
            )
            self._seen[generator_id] = now

    def incarnations(self) -> dict[str, str]:
        """Each generator's process, as its last request named it: kept in a checkpoint."""
        return {gid: status.incarnation for gid, status in self.status.items() if status.incarnation}

    def forget(self, generator_id: str) -> None:
        """Drop a generator that left or went silent; a request from it later starts afresh."""
        self.status.pop(generator_id, None)
        self._seen.pop(generator_id, None)

    def silent(self, now: float) -> set[str]:
        """Generators whose last request is older than ``lease_s``."""
        return {g for g, seen in self._seen.items() if seen < now - self.lease_s}

    def lagging(self, latest: tuple[str, int], now: float) -> list[str]:
        """Live generators, not told to stop, that report other weights than ``latest`` (session, version)."""
        return [
            g.generator_id
            for g in self.status.values()
            if g.weight_version >= 0  # not a placeholder restored from a checkpoint
            and (g.weight_session, g.weight_version) != latest
            and now - self._seen[g.generator_id] < self.lease_s
            and g.generator_id not in self.told_to_stop
        ]
