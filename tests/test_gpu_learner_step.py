"""On a GPU, a bf16 learner's step waits on the GPU a handful of times, not once per weight tensor.

Without ZeRO, DeepSpeed's 16-bit optimizer tests each tensor's gradient for overflow on the host, so a step
waited on the GPU as many times as the model has tensors (282 for SmolLM2-135M's 272 on one H100). One bf16
rank now takes stage 1, DeepSpeed's bf16 optimizer over flat buffers; the same step with ``zero_stage: 0`` shows
what the test guards against.
"""

import pytest
from conftest import rollouts_of_lengths

pytestmark = pytest.mark.gpu

LAYERS = 8  # 9 tensors a layer, 74 in all: a per-tensor wait would be far above the bound below


def tiny_llama(folder) -> str:
    """An HF folder of a random 8-layer Llama (the learner loads it in bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def waits_in_one_step(torch, model_path: str, zero_stage: int | None) -> tuple[str, int]:
    """The optimizer DeepSpeed built, and how many times one step's host waited on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.config import load_config
    from learners.engine import build_engine, init_distributed
    from learners.ranks import Ranks
    from learners.step import PolicyStep

    init_distributed()
    overrides = [f"--model.path={model_path}", "--model.dtype=bfloat16", "--learner.pack_sequences=false"]
    overrides += ["--learner.share_prompts=false"] + (
        [f"--learner.zero_stage={zero_stage}"] if zero_stage is not None else []
    )
    config = load_config("configs/arith-smollm2.yaml", overrides)
    engine, _ = build_engine(config.learner, config.model, logprob_chunk_tokens=256)
    step = PolicyStep(config, engine, Ranks(0, 1, None))
    batch = rollouts_of_lengths([(20, 12)] * 16)
    step.run(batch, [])  # warm: kernels compiled, buffers allocated
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step.run(batch, [])
        torch.cuda.synchronize()
    waits = sum(1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    return type(engine.optimizer).__name__, waits


def test_a_bf16_learner_step_waits_on_the_gpu_a_few_times_not_once_per_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model_path = tiny_llama(tmp_path / "model")
    optimizer, waits = waits_in_one_step(torch, model_path, None)
    per_tensor, waits_without_zero = waits_in_one_step(torch, model_path, 0)
    print(f"{optimizer}: {waits} waits a step; {per_tensor} (zero_stage 0): {waits_without_zero}")
    assert optimizer == "BF16_Optimizer"
    assert waits < 20
    assert waits_without_zero > 9 * LAYERS  # the regression this guards against, seen on the same step
