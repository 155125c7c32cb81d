"""vLLM on a GPU (the release the GPU machines run) refuses a prompt that fills ``max_model_len``: the
backend raises PromptRefused for that batch, in that release's words, and serves the next one. Closed, the
engine leaves no process group behind."""

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_a_prompt_the_gpu_engine_refuses_fails_alone_and_the_closed_engine_leaves_no_group():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = ROOT / "models/smollm2-135m"
    if not (model / "config.json").exists():
        pytest.skip("asyncrl model import smollm2-135m models/smollm2-135m first")
    from generators.base import GenerationRequest, PromptRefused, SamplingParams
    from generators.vllm_backend import VllmBackend

    backend = VllmBackend(str(model), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.2)
    try:
        fits = [GenerationRequest(f"q{i}", [1, 2, 3 + i]) for i in range(2)]
        with pytest.raises(PromptRefused, match="256"):
            list(
                backend.generate(
                    [*fits, GenerationRequest("too-long", [1] + [3] * 300)], SamplingParams(n=1, max_new_tokens=4)
                )
            )
        out = list(backend.generate(fits, SamplingParams(n=1, max_new_tokens=4, temperature=0.0)))
        assert sorted(r.request_id for r, _ in out) == ["q0", "q1"]
        assert all(len(samples[0].token_ids) == 4 for _, samples in out)
    finally:
        backend.close()
    assert not torch.distributed.is_initialized(), "the engine's process group outlived it"
