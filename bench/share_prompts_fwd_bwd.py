"""One step's forward and backward of the learner's log-prob model, prompts in full against prompts held once.

    python bench/share_prompts_fwd_bwd.py MODEL_DIR            # a folder with config.json and a tokenizer

A random-init model of MODEL_DIR's shape (bf16, varlen attention, no DeepSpeed, no Liger), 16 groups of 8
rollouts to 100-token prompts, answers of 84 and then 22 tokens; each layout timed over six repeats between
CUDA synchronisations (median of the last four), twice in turn. With ``--floor`` it times prompts held once at
1, 4, 16 and 32 groups of 22-token answers instead: what a step costs before its tokens do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    import torch
    from test_packing import _groups_of
    from transformers import AutoConfig, AutoModelForCausalLM

    import learners.attention  # noqa: F401  (registers varlen)
    from learners.engine import PolicyLogprobs
    from learners.packing import pack

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--floor", action="store_true")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.model)
    config._attn_implementation = "varlen"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16)
    model.config._attn_implementation = "varlen"
    policy = PolicyLogprobs(model, 8192)

    def timed(groups: int, answer: int, shared: bool) -> tuple[int, float, list[float]]:
        rollouts = _groups_of([100] * groups, [[answer] * 8] * groups)
        batch = pack(rollouts, True, [1.0] * len(rollouts), shared=shared).to("cuda")
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            started = time.perf_counter()
            logprobs, _ = policy(batch.ids, None, batch.targets, 1.0, batch.position_ids, **batch.logprob_options())
            (logprobs * batch.mask).sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return batch.ids.numel(), sorted(times[2:])[1], times

    cases = (
        [(groups, 22, True) for groups in (1, 4, 16, 32)]
        if args.floor
        else [(16, answer, shared) for answer in (84, 22) for shared in (False, True, False, True)]
    )
    for groups, answer, shared in cases:
        tokens, median, times = timed(groups, answer, shared)
        print(
            f"groups {groups} answer {answer} shared {shared} tokens {tokens} fwd+bwd median {median * 1000:.1f} ms "
            f"all {[round(t * 1000, 1) for t in times]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
