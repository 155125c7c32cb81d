"""asyncrl's policy loss beside TRL's own GRPO loss on one logged batch: the loss and its gradient.

A run that logs every sample of a step (``learner.rollout_samples_per_step`` at least the step's
samples) gives the batch: its prompts, responses, behaviour log-probs and advantages. The same fp32
model then takes the gradient of asyncrl's ``policy_loss`` and of ``GRPOTrainer._compute_loss``
(``loss_type="dapo"``, one iteration per batch, TRL's importance-sampling correction off), in chunks of
16 samples over the whole batch's token count. Identical losses give a gradient cosine of 1 and a norm
ratio of 1; TRL also recomputes the group advantages from the rewards, which must match the logged ones.

    asyncrl run configs/arith-smollm2.yaml --run-dir /tmp/onpolicy --staleness.max_staleness=0 \\
      --learner.total_steps=1 --learner.rollout_samples_per_step=128 ...
    python bench/trl_loss_parity.py /tmp/onpolicy --step 1 --out bench/results/trl_loss_parity.json

Needs ``pip install .[bench]`` (TRL).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import provenance  # noqa: E402

CHUNK = 16


def asyncrl_gradient(model, config, rollouts, advantages):
    """asyncrl's policy loss and gradient on ``rollouts``, through the learner's own log-probs."""
    from learners.algo import loss_config
    from learners.engine import PolicyLogprobs
    from learners.packing import pack
    from learners.policy_loss import policy_loss

    policy = PolicyLogprobs(model, config.learner.logprob_chunk_tokens)  # the learner's own log-probs

    tokens, total = sum(len(r.response_ids) for r in rollouts), 0.0
    for start in range(0, len(rollouts), CHUNK):
        chunk = slice(start, start + CHUNK)
        batch = pack(rollouts[chunk], False, advantages[chunk])
        logprobs, _ = policy(batch.ids, batch.attention_mask, batch.targets, config.generator.temperature)
        loss = policy_loss(
            logprobs,
            batch.behaviour,
            batch.advantages,
            batch.mask,
            loss_config(config.algo),
            num_tokens=tokens,
            num_sequences=len(rollouts),
        ).loss
        loss.backward()
        total += loss.item()
    return total, take_gradient(model)


def trl_gradient(model, config, rollouts, logged_advantages, pad_id: int, output_dir: str = "/tmp/trl_loss_parity"):
    """TRL's loss and gradient on ``rollouts``, and the largest gap between TRL's group advantages (recomputed
    from the rewards) and ``logged_advantages``."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    size, algo = config.generator.samples_per_prompt, config.algo
    args = GRPOConfig(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        loss_type="dapo",
        beta=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        epsilon=algo.clip_eps,
        epsilon_high=algo.clip_eps_high,
        delta=algo.dual_clip,
        num_generations=size,
        per_device_train_batch_size=len(rollouts),
        max_completion_length=config.generator.max_new_tokens,
        temperature=config.generator.temperature,
        scale_rewards="group",
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "-"}] * size),
    )
    trainer.current_gradient_accumulation_steps = 1
    prompt_len = max(len(r.prompt_ids) for r in rollouts)
    response_len = max(len(r.response_ids) for r in rollouts)

    def left(ids):
        return [pad_id] * (prompt_len - len(ids)) + list(ids), [0] * (prompt_len - len(ids)) + [1] * len(ids)

    def right(ids):
        return list(ids) + [pad_id] * (response_len - len(ids)), [1] * len(ids) + [0] * (response_len - len(ids))

    prompts, responses = [left(r.prompt_ids) for r in rollouts], [right(r.response_ids) for r in rollouts]
    rewards = torch.tensor([r.reward for r in rollouts]).view(-1, size)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    inputs = {
        "prompt_ids": torch.tensor([p for p, _ in prompts]),
        "prompt_mask": torch.tensor([m for _, m in prompts]),
        "completion_ids": torch.tensor([c for c, _ in responses]),
        "completion_mask": torch.tensor([m for _, m in responses]),
        "advantages": advantages,
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    total = 0.0
    for start in range(0, len(rollouts), CHUNK):
        chunk = {k: v[start : start + CHUNK] if v.dim() else v for k, v in inputs.items()}
        loss = trainer._compute_loss(trainer.model, chunk)
        loss.backward()
        total += loss.item()
    logged = torch.stack([a[0] for a in logged_advantages])
    return total, take_gradient(model), float((advantages - logged).abs().max())


def take_gradient(model):
    import torch

    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run that logged every sample of --step")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config
    from learners.rollout_sample import trained

    config = load_config(args.run_dir / "config.yaml")
    size = config.generator.samples_per_prompt
    rollouts, advantages = trained(args.run_dir, size).get(args.step, ([], []))
    groups = [rollouts[i : i + size] for i in range(0, len(rollouts), size)]
    if not rollouts or len(rollouts) % size or any(len({r.group_id for r in group}) != 1 for group in groups):
        sys.exit(f"step {args.step} of {args.run_dir}: not whole groups of {size} in order (log all its samples)")
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    model.train()
    pad_id = AutoTokenizer.from_pretrained(config.model.path).pad_token_id or 0
    ours, ours_grad = asyncrl_gradient(model, config, rollouts, advantages)
    theirs, theirs_grad, advantage_gap = trl_gradient(model, config, rollouts, advantages, pad_id)
    report = {
        "run_dir": str(args.run_dir),
        "step": args.step,
        "samples": len(rollouts),
        "loss_asyncrl": ours,
        "loss_trl": theirs,
        "gradient_norm_ratio": float(ours_grad.norm() / theirs_grad.norm()),
        "gradient_cosine": float(torch.nn.functional.cosine_similarity(ours_grad.double(), theirs_grad.double(), 0)),
        "advantage_max_gap": advantage_gap,
    }
    provenance.publish(report, args.out)


if __name__ == "__main__":
    main()
