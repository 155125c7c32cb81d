"""The wire messages of the control plane: work requests and replies, evaluations, status, and step orders.

Generators ask the learner's coordinator for prompt tickets with these,
``asyncrl status`` asks it for a snapshot, and learner rank 0 orders every
rank's next step. Import them from :mod:`asyncrl.wire.protocol`, the one
module that defines what crosses a process boundary.
"""

from __future__ import annotations

import msgspec

from asyncrl.wire.rollouts import Rollout
from asyncrl.wire.schema import Count, Seconds, TaggedMessage
from asyncrl.wire.weights import WeightUpdate


class PromptTicket(msgspec.Struct, frozen=True):
    """The right to generate one group of ``group_size`` samples for a prompt."""

    prompt_index: int
    group_id: str


class WorkRequest(TaggedMessage, tag="work_request"):
    """A generator asks for prompts. Doubles as its heartbeat."""

    generator_id: str
    weight_version: Count
    max_groups: Count  # a negative one would hand slots back to the staleness bound
    weight_session: str = ""  # WeightUpdate.session of the weights it serves ("": the model it started with)
    # Tickets it will never answer because its engine refused their prompt (too long for it): group id -> why.
    # The learner frees their slots and issues those prompts no more.
    refused: dict[str, str] = {}
    samples_generated: Count = 0
    # The response tokens of those samples (an episode's environment replies included): what evaluation's
    # share (eval.max_share) is earned from.
    tokens_generated: Count = 0
    busy_s: Seconds = 0.0
    reward_failures: dict[str, Count] = {}  # rewards that failed (rollouts sent reward_failed), by reason, since start
    wait_s: Seconds = 0.0  # with no work for it yet, the learner may hold the request this long (a long poll)
    incarnation: str = ""  # new for every process start: a generator restarted under its id is told apart
    # A drained generator's goodbye (it holds no tickets): the learner forgets it now, not after its lease.
    leaving: bool = False
    # New for every ask, the same when a timed-out ask is sent again: a reply with tickets that was lost on the
    # way is sent again rather than followed by new tickets, which would leave the lost ones out until
    # coordinator.ticket_timeout_s.
    request_id: str = ""
    # Groups written whole to a buffer that keeps them past this process's end (Redis), since its last request
    # that was answered: should this generator be lost or restart, the learner waits for those to arrive rather
    # than having them generated again.
    written: list[str] = []
    run_id: str = ""  # coordinator.run_id of the generator's config: the learner refuses another run's generator


class EvalTicket(msgspec.Struct, frozen=True):
    """Held-out prompts (indices into the task's eval items) to evaluate for the eval of ``version``."""

    version: int
    indices: list[int]
    k: int  # samples per prompt for pass@k, besides the greedy one
    temperature: float
    max_new_tokens: int


class WorkReply(TaggedMessage, tag="work_reply"):
    """Prompts to generate now (possibly none), the latest weights, and maybe a piece of an evaluation.

    An empty ``tickets`` list is backpressure: generating more now would
    produce samples that could not be trained on within ``max_staleness``.
    """

    tickets: list[PromptTicket]
    latest: WeightUpdate | None = None
    stop: bool = False
    retry_after_s: float = 0.0
    eval: EvalTicket | None = None
    reason: str = ""  # with stop, when it is not that the learner is done


class EvalTrace(msgspec.Struct, kw_only=True):
    """One evaluated response: what was asked, what came back, how it scored, under which weights."""

    index: int  # into the task's eval items
    prompt: str
    response: str
    answer: str | None  # the final answer the reward extracted, where it extracts one
    reward: float
    version: int
    greedy: bool
    label: str | None = None  # the item's reference answer (its ``label``), to read beside ``answer``
    reward_failed: bool = False  # the reward raised or ran out of time: scored 0, and counted
    # a multi-turn episode's whole conversation ({"role", "content"} messages, every turn and reply); the
    # response is its last turn
    turns: list[dict[str, str]] = []
    tool_calls: int = 0
    tokens: int = 0  # its response tokens (an episode's every turn and reply): its cost under eval.max_share


class EvalReport(TaggedMessage, tag="eval_report"):
    """A generator's results for one :class:`EvalTicket`."""

    generator_id: str
    version: int  # the eval this belongs to (the ticket's)
    indices: list[int]
    traces: list[EvalTrace]


class Ack(TaggedMessage, tag="ack"):
    """The learner took a report."""


class StatusRequest(TaggedMessage, tag="status_request"):
    """Asks a learner for a :class:`Status` snapshot."""


class GeneratorStatus(msgspec.Struct, kw_only=True):
    """What a learner knows about one generator from its heartbeats."""

    generator_id: str
    weight_version: int
    samples_generated: int
    busy_s: float
    last_seen_s: float
    reward_failures: dict[str, int] = {}
    incarnation: str = ""
    weight_session: str = ""


class Status(TaggedMessage, tag="status"):
    """A snapshot of a running learner, for ``asyncrl status``."""

    step: int
    total_steps: int
    version: int
    max_staleness: int
    samples_consumed: int
    samples_dropped: dict[str, int]
    samples_admitted: int
    buffer: dict[str, float]
    generators: list[GeneratorStatus]
    rejected: dict[str, int] = {}  # buffer entries refused, by reason
    generator_lease_s: float = 0.0  # silent this long, a generator's tickets are reissued
    reward: float | None = None
    started_s: float = 0.0
    now_s: float = 0.0
    samples_per_s: float | None = None  # trained, since the run's first batch (None before the first step)
    run_id: str = ""  # coordinator.run_id of the learner's run: a reader of another run's folder can tell


class ErrorReply(TaggedMessage, tag="error"):
    """A server's answer to a request whose handler failed; the server keeps serving."""

    reason: str


# --- between learner ranks (typed, not tagged) ---


class StepOrder(msgspec.Struct):
    """What learner rank 0 tells every rank to do next (sent over the ranks' gloo group)."""

    batch: list[Rollout]
    checkpoint: bool = False
    stale_peers: list[Rollout] = []  # members of the batch's groups dropped as stale: in their group's statistics
    stop: bool = False  # stop now (SIGTERM, or no more batches): no final evaluation
    finish: bool = False  # the training budget is spent: finish as after the last step
