"""One learner step, asyncrl's engine against a plain torch AdamW step on the same rollouts.

Samples one batch of GRPO groups from the config's model and task (16 prompts
x 8 samples by default, transformers sampling, cached in ``--cache``), then
takes one optimizer step on it several ways from the same starting weights:

- ``plain``: fp32 weights, torch AdamW, the token-mean GRPO loss written out
  here (what TRL's ``loss_type="dapo"`` computes with one iteration per batch);
- ``asyncrl <dtype> zero<k>``: the learner's DeepSpeed engine and policy loss;
- ``asyncrl bfloat16 zero0 rounded-master``: the engine with its fp32 master
  weights started from the bf16 rounding of the checkpoint (DeepSpeed's own
  behaviour, before ``learners.masters.set_master_weights``).

For each it reports how far the step moved the policy on the batch, with the
weights the generator would sample from: the mean change of the sampled
tokens' log-probs weighted by their advantages (the objective's first-order
gain), the k3 KL estimate, and the share of weights whose sampling copy changed.

    asyncrl model import smollm2-135m models/smollm2-135m
    python bench/update_parity.py --config configs/arith-smollm2.yaml --out bench/results/update_parity.json

Each asyncrl variant's gain, beside plain AdamW's under the same sampling
dtype, is appended to ``bench/records/update_parity.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402


def sample_batch(cfg, groups: int, per_group: int, device: str, cache: Path | None):
    """``groups`` x ``per_group`` rollouts of the task's first prompts, with rewards; behaviour log-probs are 0."""
    import msgspec
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.tasks import open_task
    from asyncrl.wire.protocol import Rollout

    if cache is not None and cache.exists():
        return msgspec.msgpack.decode(cache.read_bytes(), type=list[Rollout])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task = open_task(cfg.task, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).to(device)
    eos = tokenizer.eos_token_id
    rollouts = []
    for g in range(groups):
        item = task.items[g]
        prompt = task.prompt_ids(item)
        ids = torch.tensor([prompt] * per_group, device=device)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=cfg.generator.max_new_tokens,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        for k in range(per_group):
            response = out[k, len(prompt) :].tolist()
            finished = eos in response
            if finished:
                response = response[: response.index(eos) + 1]
            text = tokenizer.decode(response, skip_special_tokens=True)
            rollouts.append(
                Rollout(
                    rollout_id=f"{g}-{k}",
                    group_id=str(g),
                    group_size=per_group,
                    prompt_index=g,
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=[0.0] * len(response),
                    versions=[0] * len(response),
                    reward=float(task.reward(text, item)),
                    finish_reason="stop" if finished else "length",
                    generator_id="update_parity",
                    created_s=time.time(),
                )
            )
    if cache is not None:
        cache.write_bytes(msgspec.msgpack.encode(rollouts))
    return rollouts


def logprobs(model, rollouts, device: str, rows: int = 8):
    """Per-token log-probs of the responses, ``[n, T]`` laid out as :func:`learners.packing.pack` lays them."""
    import torch

    from learners.packing import pack

    ids, attention, _, targets, _, mask, _, _ = pack(rollouts, False, [0.0] * len(rollouts))[:8]
    out = []
    for s in range(0, len(rollouts), rows):
        logits = model(input_ids=ids[s : s + rows].to(device), attention_mask=attention[s : s + rows].to(device)).logits
        out.append(
            torch.log_softmax(logits.float(), -1)
            .gather(-1, targets[s : s + rows].to(device).unsqueeze(-1))
            .squeeze(-1)
            .cpu()
        )
    return torch.cat(out), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/arith-smollm2.yaml")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-tokens", type=int, default=None, help="learner.max_tokens_per_microbatch")
    parser.add_argument(
        "--variants", nargs="+", default=["float32:0", "bfloat16:0", "bfloat16:0:rounded", "float32:3", "bfloat16:3"]
    )
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps, each on the same batch")
    parser.add_argument("--cache", type=Path, default=None, help="keep the sampled batch here and reuse it")
    parser.add_argument("--out", type=Path, default=None)
    records.add_argument(parser, "update_parity")
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    import msgspec
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.config import ModelConfig, load_config
    from learners.algo import loss_config, step_advantages
    from learners.engine import build_engine, gathered_parameters, init_distributed
    from learners.masters import set_master_weight
    from learners.packing import microbatches, pack
    from learners.policy_loss import policy_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    cfg = load_config(args.config)
    batch = sample_batch(cfg, args.groups, args.per_group, device, args.cache)
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).to(device)
    with torch.no_grad():
        start, mask = logprobs(base, batch, device)
    # Behaviour log-probs: the starting fp32 policy's own, so every ratio starts at 1.
    batch = [msgspec.structs.replace(r, logprobs=start[i][mask[i] > 0].tolist()) for i, r in enumerate(batch)]
    max_new = cfg.generator.max_new_tokens
    advantages = step_advantages(batch, cfg.algo, max_new)
    per_rollout = [float(a) if torch.as_tensor(a).dim() == 0 else float(torch.as_tensor(a).mean()) for a in advantages]
    num_tokens = sum(len(r.response_ids) for r in batch)
    lc = cfg.learner
    micro_tokens = args.micro_tokens or lc.max_tokens_per_microbatch

    starts: dict[torch.dtype, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}

    def start_of(sampling_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The starting weights as the generator holds them in ``sampling_dtype``, and their log-probs."""
        if sampling_dtype not in starts:
            before = copy.deepcopy(base)
            before.load_state_dict({k: v.to(sampling_dtype).float() for k, v in base.state_dict().items()})
            with torch.no_grad():
                starts[sampling_dtype] = (before.state_dict(), logprobs(before, batch, device)[0])
        return starts[sampling_dtype]

    def moved(weights: dict[str, torch.Tensor], sampling_dtype: torch.dtype) -> dict:
        """How the step moved the policy the generator samples from (``weights`` cast to ``sampling_dtype``)."""
        before, lp0 = start_of(sampling_dtype)
        after = copy.deepcopy(base)
        after.load_state_dict({k: v.to(sampling_dtype).float() for k, v in weights.items()}, strict=False)
        with torch.no_grad():
            lp1, _ = logprobs(after, batch, device)
        d = lp1 - lp0
        gain = sum(float(d[i][mask[i] > 0].sum()) * per_rollout[i] for i in range(len(batch))) / num_tokens
        log_r = d[mask > 0]
        trained = after.state_dict()
        changed = sum(int((trained[k] != before[k]).sum()) for k in weights)
        total = sum(v.numel() for v in weights.values())
        return {
            "objective_gain": gain,
            "kl_k3": float((torch.exp(-log_r) - 1 + log_r).mean()),
            "weights_changed": changed / total,
        }

    results = []
    # plain: fp32 AdamW on the token-mean GRPO loss, in rows of 8 (gradients accumulate)
    plain = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay)
    ids, attention, _, targets, behaviour, m, adv, _ = pack(batch, False, advantages)[:8]
    loss_cfg = loss_config(cfg.algo)
    for _ in range(args.steps):
        optimizer.zero_grad()
        for s in range(0, len(batch), 8):
            rows = slice(s, s + 8)
            logits = plain(input_ids=ids[rows].to(device), attention_mask=attention[rows].to(device)).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[rows].to(device).unsqueeze(-1)).squeeze(-1)
            # asyncrl's clipped loss against the sampling log-probs; at the first step every ratio is 1,
            # and it is the token-mean GRPO loss
            policy_loss(
                lp,
                behaviour[rows].to(device),
                adv[rows].to(device),
                m[rows].to(device),
                loss_cfg,
                num_tokens=num_tokens,
                num_sequences=len(batch),
                horizon=max_new,
            ).loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), lc.grad_clip))
        optimizer.step()
    weights = {k: v.detach() for k, v in plain.state_dict().items()}
    results.append(
        {
            "variant": "plain fp32 AdamW",
            "grad_norm": grad_norm,
            "fp32_sampling": moved(weights, torch.float32),
            "bf16_sampling": moved(weights, torch.bfloat16),
        }
    )
    print(json.dumps(results[-1]), flush=True)
    del plain, optimizer

    init_distributed()
    for variant in args.variants:
        dtype, stage, *flags = variant.split(":")
        learner = msgspec.structs.replace(
            lc, zero_stage=int(stage), max_tokens_per_microbatch=micro_tokens, pack_sequences=False
        )  # padded rows under sdpa, as the plain loop runs
        engine, model = build_engine(learner, ModelConfig(path=cfg.model.path, dtype=dtype), lc.logprob_chunk_tokens)
        if "rounded" in flags:
            for _, param in model.named_parameters():
                if not set_master_weight(engine, param, param.detach().float()):
                    raise SystemExit(f"{variant}: the optimizer keeps no fp32 master weights")
        micro = microbatches([len(r.prompt_ids) + len(r.response_ids) for r in batch], micro_tokens, False)
        engine.train()
        for k, rows in [(k, rows) for _ in range(args.steps) for k, rows in enumerate(micro)]:
            ids, attention, positions, targets, behaviour, m, adv, _ = pack(
                [batch[i] for i in rows], False, [advantages[i] for i in rows]
            ).to(engine.device)[:8]
            engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
            lp, _ = engine(ids, attention, targets, cfg.generator.temperature, positions)
            stats = policy_loss(
                lp, behaviour, adv, m, loss_cfg, num_tokens=num_tokens, num_sequences=len(batch), horizon=max_new
            )
            engine.backward(stats.loss, scale_wrt_gas=False)
            engine.step()
        weights = {k: v.float() for k, v in gathered_parameters(model, device=device)}
        sampling = torch.float32 if dtype == "float32" else torch.bfloat16
        results.append(
            {
                "variant": f"asyncrl {dtype} zero{stage}" + (" rounded-master" if flags else ""),
                "microbatches": len(micro),
                "sampling": moved(weights, sampling),
            }
        )
        print(json.dumps(results[-1]), flush=True)
        del engine, model
        torch.cuda.empty_cache() if device == "cuda" else None

    report = {
        "benchmark": "one learner step on one batch: asyncrl's engine against plain fp32 AdamW",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(device),
        "git": _git(),
        "command": " ".join(sys.argv),
        "config": args.config,
        "samples": len(batch),
        "response_tokens": num_tokens,
        "mean_reward": sum(r.reward for r in batch) / len(batch),
        "lr": lc.lr,
        "steps": args.steps,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    from bench.provenance import stamp

    records.write(args.records, records_of(report, stamp(device == "cuda")))


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Each asyncrl variant's objective gain under the weights the generator samples from, beside plain fp32
    AdamW's gain under the same sampling dtype. One step on one batch: n = 1."""
    plain = next(r for r in report["results"] if r["variant"].startswith("plain"))
    settings = {key: report.get(key) for key in ("config", "samples", "response_tokens", "lr", "steps")}
    out = []
    for result in report["results"]:
        if result is plain:
            continue
        sampling = "fp32_sampling" if " float32 " in f" {result['variant']} " else "bf16_sampling"
        out.append(
            records.measure(
                at,
                bench="update_parity",
                case=result["variant"],
                metric="objective_gain",
                unit="advantage-weighted log-prob change",
                repeats=[result["sampling"]["objective_gain"]],
                vs=records.peer(
                    f"plain fp32 AdamW, {sampling.split('_')[0]} sampling", [plain[sampling]["objective_gain"]]
                ),
                settings=settings,
            )
        )
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def _git() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
