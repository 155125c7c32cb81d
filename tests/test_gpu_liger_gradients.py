"""On a GPU: Liger's kernels (``learner.liger_kernels``) change how the learner computes, not what.

The policy's log-probs and every parameter's gradient of a policy-gradient loss, with Liger's RMSNorm,
SwiGLU and RoPE kernels and without, on SmolLM2-135M-Instruct: in fp32 they agree to rounding; in bf16
each is as close to the fp32 gradients as the other. Liger patches transformers' classes for the whole
process, so the comparison runs in a child process of its own.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.gpu]

MODEL = ROOT / "models/smollm2-135m"


def gradients(model, ids, advantages):
    """Log-probs of ``ids`` under ``model`` (the learner's own wrapper) and the gradient of ``-A * logp``."""
    import torch

    from learners.engine import PolicyLogprobs

    policy = PolicyLogprobs(model, chunk_tokens=64)
    model.zero_grad()
    logprobs, _ = policy(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    logprobs = logprobs[:, :-1].float()
    (-(logprobs * advantages).mean()).backward()
    grads = {name: p.grad.detach().float().flatten().clone() for name, p in model.named_parameters()}
    return logprobs.detach(), grads


def compare() -> dict:
    """Liger against transformers' modules, fp32 and bf16, each against fp32 without Liger.

    Every model without Liger runs before the first patch: Liger's RoPE replaces transformers'
    function for the whole process, which a model built earlier would then call too."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from learners.models import apply_liger

    torch.manual_seed(0)
    fp32 = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()
    ids = torch.randint(0, fp32.config.vocab_size, (4, 128), device="cuda")
    advantages = torch.randn(4, 127, device="cuda")
    reference_lp, reference = gradients(fp32, ids, advantages)
    dtypes = ("float32", "bfloat16")
    models = {(dtype, "plain"): copy.deepcopy(fp32).to(getattr(torch, dtype)) for dtype in dtypes}
    measured = {key: gradients(model, ids, advantages) for key, model in models.items()}
    for dtype in dtypes:
        liger = copy.deepcopy(models[dtype, "plain"])
        apply_liger(liger)
        measured[dtype, "liger"] = gradients(liger, ids, advantages)
    out = {}
    for (dtype, name), (lp, grads) in measured.items():
        rel = {k: ((grads[k] - g).norm() / g.norm()).item() for k, g in reference.items()}
        error = sum((grads[k] - g).square().sum() for k, g in reference.items())
        out[f"{dtype} {name}"] = {
            "logprob_max_diff": (lp - reference_lp).abs().max().item(),
            "logprob_mean_diff": (lp - reference_lp).abs().mean().item(),
            # the whole gradient's error relative to its norm: what the optimizer step sees
            "grad_rel_err": (error / sum(g.square().sum() for g in reference.values())).sqrt().item(),
            "grad_rel_err_max": max(rel.values()),
            "grad_rel_err_worst": max(rel, key=rel.get),
        }
    return out


def test_liger_gives_the_learner_the_same_logprobs_and_gradients(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if not (MODEL / "config.json").exists():
        pytest.skip("asyncrl model import smollm2-135m models/smollm2-135m first")
    out = tmp_path / "gradients.json"
    subprocess.run([sys.executable, __file__, str(out)], check=True, cwd=ROOT, timeout=540)
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    fp32, bf16 = result["float32 liger"], result["bfloat16 liger"]
    assert result["float32 plain"]["grad_rel_err_max"] < 1e-5  # the same model: the baseline is exact
    assert fp32["logprob_max_diff"] < 1e-3 and fp32["grad_rel_err_max"] < 1e-3, fp32
    # In bf16 both lose precision; Liger's kernels may not lose more of it than transformers' modules.
    plain = result["bfloat16 plain"]
    assert bf16["logprob_mean_diff"] < 1.25 * plain["logprob_mean_diff"], (bf16, plain)
    assert bf16["grad_rel_err"] < 1.25 * plain["grad_rel_err"], (bf16, plain)


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(ROOT))  # learners, where the project is not installed

    Path(sys.argv[1]).write_text(json.dumps(compare()))
