"""The maths of one learner step: advantages for the whole batch, then the policy (and critic) loss on each rank.

Groups are normalised whole, before the batch is split across ranks: each
rank then trains on its slice (``batch[rank::world_size]``) in micro-batches
formed by token budget. Per-token values that need a forward pass (the KL to
the reference with ``algo.kl_in: reward``, the critic's values for GAE) are
computed on each rank's slice and gathered back into batch order first.
With ``learner.mini_batches`` or ``learner.epochs`` above 1 the step makes
several optimizer updates, each over a mini-batch of whole groups, from the
advantages computed once for the batch; with an off-policy correction as well,
each rollout's log-probs under the weights before the step (the proximal
policy) are computed once, first, and every update's ratio is taken against them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from asyncrl.config import RunConfig
from asyncrl.observe import trace
from asyncrl.wire.protocol import Rollout
from learners.algo import gae_targets, loss_config, step_advantages
from learners.compiled import warm_up
from learners.critic import value_loss
from learners.engine import grad_norm_of
from learners.models import prompts_shared
from learners.packing import MicroBatch, microbatches, pack, place, response_values, shared_microbatches
from learners.policy_loss import LossCounts, PolicyLossStats, kl_penalty, policy_loss
from learners.ranks import Ranks


def explained_variance(
    batch: list[Rollout], values: list[torch.Tensor], returns: list[torch.Tensor]
) -> dict[str, float]:
    """How much of the returns' variance the critic's values (before the step) explain, and their mean.

    Rollouts whose reward failed are left out: their targets are their own values, which would read as a
    perfect critic.
    """
    scored = [i for i, rollout in enumerate(batch) if not rollout.reward_failed]
    if not scored:  # every reward of the step failed: nothing for the critic to explain
        return {"value_mean": 0.0, "value_explained_var": 0.0}
    v, r = torch.cat([values[i] for i in scored]).float(), torch.cat([returns[i] for i in scored]).float()
    var = float(r.var(unbiased=False)) if r.numel() > 1 else 0.0
    explained = 1 - float((r - v).var(unbiased=False)) / var if var > 0 else 0.0
    return {"value_mean": float(v.mean()) if v.numel() else 0.0, "value_explained_var": explained}


def mini_batches(batch: list[Rollout], count: int) -> list[list[int]]:
    """``batch``'s rows in ``count`` mini-batches of whole groups (fewer where it holds fewer groups), in batch
    order, their numbers of groups as even as can be: ``[[0, 1, ..., len(batch) - 1]]`` for a count of 1."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, rollout in enumerate(batch):
        groups[rollout.group_id].append(i)
    members = list(groups.values())
    count = min(count, len(members)) or 1
    size, extra = divmod(len(members), count)
    bounds = [k * size + min(k, extra) for k in range(count + 1)]
    return [sorted(i for group in members[a:b] for i in group) for a, b in zip(bounds, bounds[1:])]


def merged(updates: list[dict[str, float]]) -> dict[str, float]:
    """A step's statistics from those of its optimizer updates: each figure's mean over them (micro-batches
    summed, the largest importance ratio the largest), and their number as ``updates``."""
    stats = {key: sum(u[key] for u in updates) / len(updates) for key in updates[0]}
    if "is_ratio_max" in stats:
        stats["is_ratio_max"] = max(u["is_ratio_max"] for u in updates)
    return {**stats, "microbatches": sum(u["microbatches"] for u in updates), "updates": len(updates)}


class PolicyStep:
    """One rank's optimizer step over a batch: GRPO, PPO with GAE, and the other estimators of ``algo``.

    ``engine`` is the policy's DeepSpeed engine, ``reference`` the frozen starting policy (when
    ``algo.kl_coef > 0``) and ``critic`` the value model's engine (when ``algo.advantage`` is gae).
    """

    def __init__(self, config: RunConfig, engine, ranks: Ranks, reference=None, critic=None) -> None:
        if not isinstance(config.learner.pack_sequences, bool):
            raise ValueError(
                "learner.pack_sequences auto is settled when the engine is built "
                "(learners.models.resolve_packing), before the learner starts"
            )
        self.shared = prompts_shared(config.learner)
        self.config, self.engine, self.ranks = config, engine, ranks
        self.reference, self.critic = reference, critic
        self.loss = loss_config(config.algo)
        self.last_advantages: list[torch.Tensor] | None = None
        # Rollouts whose log-probs under the learner's weights at the step are kept (rank 0's sample, by id),
        # and what was kept of them in the last step.
        self.keep: set[str] = set()
        self.learner_logprobs: dict[str, list[float]] = {}
        # DeepSpeed reports the gradient norm where ZeRO or a bf16/fp16 optimizer clips; for fp32 without
        # ZeRO (one CPU rank by default) the step measures it before the optimizer steps.
        self.norm_of_module_grads = not (
            engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()
        )

    def compile_now(self) -> float | None:
        """``learner.compile``: compile the policy's layers on made-up rollouts laid out as this step lays out
        its own (:func:`learners.compiled.warm_up`); the seconds it took, or None where the first step will."""
        vocab_size = self.engine.module.model.config.vocab_size
        return warm_up(self.engine, self._layout(), self.config.generator.temperature, vocab_size)

    def run(self, batch: list[Rollout], stale_peers: list[Rollout]) -> dict[str, float]:
        """Advantages for the whole ``batch``, then this rank's share of the step; returns the step's statistics."""
        algo, max_new_tokens, mine = self.config.algo, self.config.generator.max_new_tokens, self.ranks.mine
        token_kl = self.ranks.gather_shards(self.reward_kl(mine(batch))) if algo.kl_in == "reward" else None
        values = returns = None
        with trace.span("advantages"):
            if self.critic is not None:
                values = self.ranks.gather_shards(self.critic_values(mine(batch)))
                advantages, returns = gae_targets(batch, algo, max_new_tokens, values, token_kl)
            else:
                advantages = step_advantages(batch, algo, max_new_tokens, token_kl, stale_peers)
        self.last_advantages = advantages  # the whole batch's, per token: a sample of them is kept (rank 0)
        self.learner_logprobs = {}
        learner, proximal = self.config.learner, None
        parts = mini_batches(batch, learner.mini_batches)  # fewer where the step holds fewer groups
        if len(parts) * learner.epochs > 1 and algo.off_policy != "none":
            with trace.span("proximal_forward"):
                proximal = self.ranks.gather_shards(self.policy_logprobs(mine(batch)))

        def share(per_rollout: list | None, rows: list[int]) -> list | None:  # this rank's part of a mini-batch
            return None if per_rollout is None else mine([per_rollout[i] for i in rows])

        inputs_of = []  # train's arguments for each mini-batch, the same in every pass
        for rows in parts:
            part = [batch[i] for i in rows]
            inputs_of.append(
                {
                    "shard": mine(part),
                    "num_tokens": sum(r.trained_tokens for r in part),
                    "num_sequences": sum(1 for r in part if r.trained_tokens),
                    "advantages": share(advantages, rows),
                    "critic_targets": (share(values, rows), share(returns, rows)) if values is not None else None,
                    "token_kl": share(token_kl, rows),
                    "proximal": share(proximal, rows),
                }
            )
        updates = [self.train(**inputs) for _ in range(learner.epochs) for inputs in inputs_of]
        stats = merged(updates)
        if values is not None:
            stats.update(explained_variance(batch, values, returns))
        return stats

    def train(
        self,
        shard: list[Rollout],
        num_tokens: int,
        num_sequences: int,
        advantages: list[torch.Tensor],
        critic_targets: tuple[list, list] | None = None,
        token_kl: list[torch.Tensor] | None = None,
        proximal: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's ``shard`` (with its per-token ``advantages``), in micro-batches.

        ``num_tokens`` and ``num_sequences`` count response tokens and non-empty
        responses over the whole batch (all ranks): DeepSpeed averages gradients
        over ranks, so normalising each rank's loss by ``count / world_size``
        yields the aggregate of the whole batch. ``critic_targets`` (old values,
        returns; per token of each rollout) train the critic in the same micro-batches.
        ``token_kl`` (``algo.kl_in: reward``): each rollout's KL to the reference,
        measured by :meth:`reward_kl` under these weights, reported as ``kl_ref``
        instead of running the reference again. ``proximal``: each rollout's log-probs
        under the weights before the step (:meth:`policy_logprobs`), the anchor of
        the ratio when the step makes several updates with an off-policy correction.
        """
        micro = self._microbatches(shard)
        count = self.ranks.max(len(micro))  # every rank must run the same collectives
        world_size = self.ranks.world_size
        totals: dict[str, float] = defaultdict(float)
        counts = LossCounts()
        module_grad_norm = None
        self.engine.train()
        for k in range(count):
            rows = micro[k] if k < len(micro) else []
            last = k == count - 1
            self.engine.set_gradient_accumulation_boundary(last)
            stats, batch = self._policy_loss(shard, rows, advantages, (token_kl, proximal), num_tokens, num_sequences)
            with trace.span("backward"):
                self.engine.backward(stats.loss, scale_wrt_gas=False)
            if last and self.norm_of_module_grads:
                module_grad_norm = grad_norm_of(self.engine.module)
            with trace.span("optimizer_step"):
                self.engine.step()
            totals["loss"] += stats.loss.item() / world_size
            if critic_targets is not None:
                totals["value_loss"] += self._critic_step(shard, rows, critic_targets, batch, last, num_tokens)
            counts = counts + stats.counts
        counts = self.ranks.merge(totals, counts)
        totals.update(counts.summary())
        grad_norm = module_grad_norm if self.norm_of_module_grads else self.engine.get_global_grad_norm()
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        totals["microbatches"] = count
        return dict(totals)

    def _microbatches(self, shard: list[Rollout]) -> list[list[int]]:
        """``shard``'s rows in micro-batches of at most ``learner.max_tokens_per_microbatch`` tokens."""
        cfg = self.config.learner
        if self.shared:
            return shared_microbatches(shard, cfg.max_tokens_per_microbatch)
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in shard]
        return microbatches(lengths, cfg.max_tokens_per_microbatch, cfg.pack_sequences)

    def _policy_loss(
        self,
        shard: list[Rollout],
        rows: list[int],
        advantages: list[torch.Tensor],
        measured: tuple[list[torch.Tensor] | None, list[torch.Tensor] | None],
        num_tokens: int,
        num_sequences: int,
    ) -> tuple[PolicyLossStats, MicroBatch]:
        """The policy's loss on one micro-batch (``rows`` of ``shard``), and the micro-batch, for the critic.

        ``measured``: the per-token values measured before the step (KL to the reference, proximal log-probs),
        each None where the step measured none.
        """
        layout = self._layout()
        rollouts = [shard[i] for i in rows]
        device = self.engine.device  # DeepSpeed leaves moving the inputs to the caller
        batch = pack(rollouts, advantages=[advantages[i] for i in rows], **layout).to(device, non_blocking=True)
        inputs = self._logprob_inputs(batch)
        reference_kl, proximal = (
            None if values is None else place(rollouts, values=[values[i] for i in rows], **layout).to(device)
            for values in measured
        )
        reference = None
        if reference_kl is None and self.reference is not None:
            with torch.no_grad(), trace.span("reference_forward"):
                reference, _ = self.reference(*inputs, **batch.logprob_options())
        with trace.span("forward", rows=int(batch.ids.shape[0]), tokens=int(batch.ids.numel())):
            logprobs, entropy = self.engine(*inputs, entropy_grad=self.loss.entropy_coef > 0, **batch.logprob_options())
        self._keep_logprobs(rollouts, logprobs if proximal is None else proximal)
        segments = batch.owner  # packed rows hold several rollouts: which one each position is
        stats = policy_loss(
            logprobs,
            batch.behaviour,
            batch.advantages,
            batch.mask,
            self.loss,
            num_tokens=max(num_tokens, 1) / self.ranks.world_size,
            num_sequences=max(num_sequences, 1) / self.ranks.world_size,
            horizon=self.config.generator.max_new_tokens,
            reference_logprobs=reference,
            reference_kl=reference_kl,
            proximal_logprobs=proximal,
            entropy=entropy,
            segment_ids=segments,
        )
        return stats, batch

    def _logprob_inputs(self, batch: MicroBatch) -> tuple:
        """The policy's and the reference's positional arguments for ``batch`` (``predicting`` goes by name)."""
        return batch.ids, batch.attention_mask, batch.targets, self.config.generator.temperature, batch.position_ids

    def _layout(self) -> dict[str, bool]:
        """How :func:`~learners.packing.pack` lays micro-batches out: packed or padded rows, prompts shared."""
        return {"packed": self.config.learner.pack_sequences, "shared": self.shared}

    def _keep_logprobs(self, rollouts: list[Rollout], logprobs: torch.Tensor) -> None:
        """The learner's log-probs of the kept rollouts among ``rollouts`` (one micro-batch)."""
        if not self.keep.intersection(r.rollout_id for r in rollouts):
            return
        values = response_values(logprobs.detach(), rollouts, **self._layout())
        # Before the step moved the weights: the proximal pass's, else the first update's to train the rollout
        # (with several mini-batches and no correction, a later one's comes after the earlier ones' updates).
        for rollout, mine in zip(rollouts, values):
            if rollout.rollout_id in self.keep and rollout.rollout_id not in self.learner_logprobs:
                self.learner_logprobs[rollout.rollout_id] = mine.float().cpu().tolist()

    def _critic_step(
        self, shard, rows, targets: tuple[list, list], batch: MicroBatch, boundary: bool, num_tokens
    ) -> float:
        """One critic micro-batch: clipped value loss against the GAE returns, in the policy's micro-batches."""
        old_values, returns = targets
        rollouts, layout, device = [shard[i] for i in rows], self._layout(), self.critic.device
        old = place(rollouts, values=[old_values[i] for i in rows], **layout).to(device)
        ret = place(rollouts, values=[returns[i] for i in rows], **layout).to(device)
        self.critic.set_gradient_accumulation_boundary(boundary)
        values = self._values(batch)
        world_size = self.ranks.world_size
        loss = value_loss(values, old, ret, batch.mask, self.config.algo.value_clip, max(num_tokens, 1) / world_size)
        self.critic.backward(loss, scale_wrt_gas=False)
        self.critic.step()
        return loss.item() / world_size

    def _per_token_pass(self, shard: list[Rollout], score: Callable) -> list[torch.Tensor]:
        """``score(batch)`` (``[rows, T]`` of a :class:`~learners.packing.MicroBatch`) at each rollout's response
        tokens, no grad.

        Laid out as training lays out its micro-batches (packed or padded rows), so
        the reference's and the critic's passes cost what the policy's forward does.
        """
        micro = self._microbatches(shard)
        layout = self._layout()
        out: list[torch.Tensor] = [torch.zeros(0)] * len(shard)
        with torch.no_grad():
            for k in range(self.ranks.max(len(micro))):  # every rank runs the same collectives
                rollouts = [shard[i] for i in micro[k]] if k < len(micro) else []
                values = score(pack(rollouts, **layout).to(self.engine.device)).float().cpu()
                for i, value in zip(micro[k] if rollouts else [], response_values(values, rollouts, **layout)):
                    out[i] = value
        return out

    def reward_kl(self, shard: list[Rollout]) -> list[torch.Tensor]:
        """Per-token KL(policy || reference) of each of this rank's rollouts, under the weights before the step.

        REINFORCE++ and GAE fold it into the returns, the group estimators into the
        reward (``algo.kl_in: reward``); it costs one forward pass of the policy
        and one of the reference, without gradients, and the step reports it as
        ``kl_ref``.
        """

        def score(batch: MicroBatch) -> torch.Tensor:
            inputs = self._logprob_inputs(batch)
            reference, _ = self.reference(*inputs, **batch.logprob_options())
            policy, _ = self.engine(*inputs, **batch.logprob_options())
            return kl_penalty(policy, reference, self.config.algo.kl_estimator)

        return self._per_token_pass(shard, score)

    def policy_logprobs(self, shard: list[Rollout]) -> list[torch.Tensor]:
        """Each response token's log-prob under the policy's weights of the moment (no grad): the proximal
        policy of decoupled PPO (AReaL), when the step's later updates will have moved those weights."""

        def score(batch: MicroBatch) -> torch.Tensor:
            logprobs, _ = self.engine(*self._logprob_inputs(batch), **batch.logprob_options())
            return logprobs

        return self._per_token_pass(shard, score)

    def critic_values(self, shard: list[Rollout]) -> list[torch.Tensor]:
        """The critic's value at each response token of this rank's rollouts, before the step."""
        return self._per_token_pass(shard, self._values)

    def _values(self, batch: MicroBatch) -> torch.Tensor:
        """The critic's value at every position of ``batch``."""
        return self.critic(batch.ids, batch.attention_mask, batch.position_ids, batch.prefix)
