"""A generator that keeps its engine full: single-turn work on an engine that takes requests while others run.

The worker's plain loop asks for a request's worth of tickets, samples them
to the last and asks again, so the engine runs ever smaller batches while a
request's slowest samples finish, and a held-out evaluation stops training
work while it runs. :class:`Streaming` instead asks for tickets while groups
are in flight (up to ``generator.max_groups_in_flight``; unset, as many as the
staleness bound admits on a GPU, a request's worth on a CPU), without a long
poll unless the engine is idle; each
group goes to the buffer the moment its samples are done, and new weights
land between two engine steps. An evaluation piece joins the training work
in the same engine, its greedy and sampled requests beside the training
ones; while a piece is in flight the generator takes no new weights, so that
each piece is answered by one version alone (the price: training requests
started meanwhile are sampled by that version too, within the staleness bound).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.wire.protocol import EvalTicket, PromptTicket, WeightUpdate
from generators.base import GenerationRequest, PromptRefused, RequestStream
from generators.evaluate import EvalPiece, answer_extractor

if TYPE_CHECKING:
    from generators.worker import GeneratorWorker

# With requests in flight, after an answer that gave fewer tickets than asked for: ask again this much later,
# or at once when a new version lands (which admits more). Each ask holds the engine while the learner answers
# (about 2 ms against a busy learner: bench/version_watch_bench.py).
ASK_AGAIN_S = 0.1


def engine_on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def max_groups_in_flight(gen: Any) -> int | None:
    """``generator.max_groups_in_flight``; unset, no cap on a GPU (the staleness bound decides: a decode step
    costs about the same for many more sequences) and a request's worth on a CPU, whose engine is bound by
    compute: there a larger batch only takes longer, and the learner waits for all of it (the CPU copy task
    trained 1,718 samples/s holding the bound's 32 groups, 2,500 holding 16)."""
    if gen.max_groups_in_flight is not None:
        return gen.max_groups_in_flight
    return None if engine_on_gpu() else gen.groups_per_request


@dataclass(frozen=True)
class _Training:
    """A training group in the stream: its prompt and when it went in."""

    prompt_index: int
    added_at: float


@dataclass(frozen=True)
class _Evaluating:
    """One prompt's run of an evaluation piece in the stream (greedy, or the ``k`` samples)."""

    piece: EvalPiece
    greedy: bool


class Streaming:
    """One :class:`~generators.worker.GeneratorWorker`'s work, run to its end by :meth:`run`."""

    def __init__(self, worker: GeneratorWorker) -> None:
        self.worker = worker
        self.link, self.weights, self.backend = worker.link, worker.weights, worker.backend
        self.gen = worker.config.generator
        self.clock = worker.clock
        self.stream = RequestStream(worker.backend)
        self.pieces: deque[EvalTicket] = deque()  # handed out, waiting for the piece in flight to end
        self.piece: EvalPiece | None = None  # the evaluation piece in flight
        self.held: WeightUpdate | None = None  # announced while a piece was in flight: loaded once it is done
        self.training = 0  # training groups in flight
        self.cap = max_groups_in_flight(self.gen)
        self.next_ask = 0.0
        self.retry_after_s = 0.0

    def run(self) -> bool:
        """Work until drained (True) or until the learner is done (False)."""
        worker = self.worker
        try:
            while True:
                if not self._ask():
                    return False
                if self.piece is None and self.pieces:
                    self.piece = self._start_piece(self.pieces.popleft())
                if not self.stream:
                    if worker.draining:
                        return True
                    worker.idle(self.retry_after_s)
                    self.next_ask = 0.0
                    continue
                started = self.clock()
                for entry, samples in self.stream.step():
                    if isinstance(entry.tag, _Evaluating):
                        self._answered(entry.tag, entry.request, samples)
                        continue
                    self.training -= 1
                    took_s = self.clock() - entry.tag.added_at
                    rollouts = worker.rollouts(entry.request, entry.tag.prompt_index, samples, took_s)
                    worker.count(rollouts)
                    if not worker.push(rollouts):
                        return False
                worker.busy_s += self.clock() - started
                if self.piece is None:
                    version = self.backend.version
                    worker.poll_for_update()
                    if self.link.stop_reason is not None:  # what is in flight is no longer wanted
                        worker.told_to_stop(self.link.stop_reason)
                        return False
                    if self.backend.version != version:  # a new version admits more work: ask for it now
                        self.next_ask = 0.0
                else:
                    self.link.heartbeat()
        finally:
            self.stream.abort()

    def _ask(self) -> bool:
        """Ask for tickets while there is room, again at once while the learner gives all that was asked for;
        False once the learner says stop."""
        while not self.worker.draining and self.clock() >= self.next_ask and (wanted := self._wanted()):
            reply = self.link.ask(wanted, wait=not self.stream)
            if reply.stop:  # what is in flight is no longer wanted
                self.worker.told_to_stop(reply.reason)
                return False
            version = self.backend.version
            if self.piece is None:
                self.weights.apply(reply.latest)
            else:
                self.held = reply.latest
            if reply.eval is not None:
                self.pieces.append(reply.eval)
            self.training += self._add_tickets(reply.tickets)
            self.retry_after_s = reply.retry_after_s
            full = len(reply.tickets) == wanted or self.backend.version != version
            self.next_ask = self.clock() + (0.0 if full else max(self.retry_after_s, ASK_AGAIN_S))
        return True

    def _wanted(self) -> int:
        """How many groups to ask for: a request's worth, up to :attr:`cap`."""
        if self.cap is None:
            return self.gen.groups_per_request
        return max(0, min(self.gen.groups_per_request, self.cap - self.training))

    def _add_tickets(self, tickets: list[PromptTicket]) -> int:
        """Put each ticket's group in flight; how many went in (a prompt the engine refuses is reported)."""
        worker, added = self.worker, 0
        for ticket in tickets:
            if self.link.known_refused(ticket):
                continue
            request = GenerationRequest(ticket.group_id, worker.prompt(ticket.prompt_index))
            try:
                self.stream.add(request, worker.params, _Training(ticket.prompt_index, self.clock()))
            except PromptRefused as exc:
                row = worker.items[ticket.prompt_index].get("row", "-")
                self.link.refuse(ticket.group_id, ticket.prompt_index, exc, row, len(request.prompt_ids))
                continue
            added += 1
        return added

    def _start_piece(self, ticket: EvalTicket) -> EvalPiece | None:
        """Put an evaluation piece's requests in flight beside the training work; None if the engine refuses
        one of its prompts (logged; the learner hands the piece out again later)."""
        worker = self.worker
        reward, extract = worker.scorer.reward_in_time, answer_extractor()
        version, stop = self.backend.version, worker.params.stop
        piece = EvalPiece(ticket, worker.eval_items, worker.build_prompt, reward, extract, version, stop, self.clock())
        try:
            for params, greedy in piece.runs:
                for request in piece.requests:
                    self.stream.add(request, params, _Evaluating(piece, greedy))
        except PromptRefused as exc:
            self.link.eval_failed(ticket, exc)
            return None  # what it sent still comes back, to no piece
        return piece

    def _answered(self, tag: _Evaluating, request: GenerationRequest, samples: list[Any]) -> None:
        """An evaluation prompt's run came back; once its piece is whole, report it and take the newest weights."""
        tag.piece.answered(request, samples, tag.greedy)
        if tag.piece is not self.piece or self.piece.left:
            return
        self.link.report_eval(self.piece.ticket, self.piece.traces, self.clock() - self.piece.started)
        self.piece = None
        self.weights.apply(self.held)
        self.held = None
