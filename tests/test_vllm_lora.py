"""vLLM serves the learner's LoRA adapter: the base with one adapter slot, each version swapped in place.

One engine (with ``learner.lora``'s adapter slot) serves the module. The
judge is transformers with peft on the same base and adapter: vLLM's log-probs
of what it sampled must be theirs, whichever way the version came: a folder,
a push over the process group (gloo here, NCCL on a GPU) or shared memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import threading  # noqa: E402

import torch  # noqa: E402
from conftest import one_generator_push, publish_adapter  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.config import LoraConfig, PushConfig  # noqa: E402
from asyncrl.launch import tiny_model  # noqa: E402
from asyncrl.weights import folders  # noqa: E402
from asyncrl.weights.adapters import AdapterView, with_adapter  # noqa: E402
from asyncrl.weights.push import open_group, spec_of  # noqa: E402
from asyncrl.weights.shared import SharedSegment  # noqa: E402
from asyncrl.weights.transports import FolderReceiver, SharedReceiver, announce_shared  # noqa: E402
from generators.base import GenerationRequest, SamplingParams  # noqa: E402
from generators.vllm_backend import VllmBackend  # noqa: E402

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=8, alpha=16.0)
HEAD = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "lm_head"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")  # heads of 32: vLLM's CPU kernels


@pytest.fixture(scope="module")
def push_config(tmp_path_factory) -> PushConfig:
    return one_generator_push(tmp_path_factory.mktemp("push"), timeout_s=10.0)


@pytest.fixture(scope="module")
def backend(model_dir, push_config):
    engine = VllmBackend(
        str(model_dir), max_model_len=256, lora=LORA, enable_prefix_caching=True, push=push_config, push_rank=1
    )
    yield engine
    engine.close()


def trained(model_dir: Path, lora: LoraConfig, seed: int):
    """A learner's peft model whose adapter training has moved from zero."""
    torch.manual_seed(seed)
    model = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return model.eval()


def worst_logprob_gap(backend, judge: torch.nn.Module, temperature: float = 0.7) -> float:
    """The largest |vLLM - transformers| log-prob over what the engine samples for a few prompts."""
    reqs = [GenerationRequest(f"q{i}", [1, 3 + i, 5, 13]) for i in range(4)]
    worst, checked = 0.0, 0
    for req, samples in backend.generate(reqs, SamplingParams(n=2, max_new_tokens=20, temperature=temperature)):
        for sample in samples:
            assert sample.versions == [backend.version] * len(sample.token_ids)
            ids = torch.tensor([req.prompt_ids + sample.token_ids])
            with torch.no_grad():
                logits = judge(input_ids=ids).logits[0, len(req.prompt_ids) - 1 : -1].float()
            expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(sample.token_ids)[:, None])
            worst = max([worst] + [abs(a - b) for a, b in zip(sample.logprobs, expected.squeeze(-1).tolist())])
            checked += len(sample.token_ids)
    assert checked > 20
    return worst


def test_the_engine_samples_the_base_at_version_0_then_each_adapter_version(backend, model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert worst_logprob_gap(backend, base) <= 1e-3  # the zero adapter: the base's own log-probs

    for version, seed in ((1, 0), (2, 1)):
        learner = trained(model_dir, LORA, seed)
        FolderReceiver().receive(publish_adapter(learner, tmp_path, version, model_dir), backend, timeout_s=60)
        assert backend.version == version
        judge = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir), folders.version_dir(tmp_path, version)
        )
        assert worst_logprob_gap(backend, judge.eval()) <= 1e-3
    assert worst_logprob_gap(backend, base) > 0.05  # the adapter is what moved them


def test_an_adapter_of_another_rank_is_refused_and_the_current_one_keeps_serving(backend, model_dir, tmp_path):
    current = trained(model_dir, LORA, seed=3)
    FolderReceiver().receive(publish_adapter(current, tmp_path, backend.version + 1, model_dir), backend, timeout_s=60)
    serving = backend.version
    wrong = trained(model_dir, LoraConfig(rank=4, alpha=16.0), seed=4)
    with pytest.raises(ValueError, match=f"weights v{serving + 1} do not match"):
        FolderReceiver().receive(publish_adapter(wrong, tmp_path, serving + 1, model_dir), backend, timeout_s=60)
    assert backend.version == serving
    assert worst_logprob_gap(backend, current) <= 1e-3


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a LoRA learner pushes or shares: its adapter's tensors, named as peft saves them."""
    return [(name, tensor.detach().clone()) for name, tensor in AdapterView(model).named_parameters()]


def test_an_adapter_pushed_over_the_process_group_is_served(backend, model_dir, push_config):
    learner = trained(model_dir, LORA, seed=5)
    tensors = adapter_tensors(learner)
    version = backend.version + 1
    sender = open_group(push_config, 0, "cpu")  # learner rank 0; the engine is rank 1, one per engine
    thread = threading.Thread(
        target=sender.send, args=(1, version, [spec_of(n, t) for n, t in tensors], tensors), daemon=True
    )
    thread.start()
    try:
        backend.receive_push(epoch=1, version=version, timeout_s=60)
    finally:
        thread.join(timeout=30)
        sender.close()
    assert backend.version == version
    assert worst_logprob_gap(backend, learner) <= 1e-3


def test_an_adapter_shared_in_memory_is_served_and_a_wrong_one_changes_nothing(backend, model_dir):
    learner = trained(model_dir, LORA, seed=6)
    tensors = adapter_tensors(learner)
    segment = SharedSegment([spec_of(n, t) for n, t in tensors], "cpu")
    version = backend.version + 1
    segment.write(version, tensors)
    SharedReceiver().receive(announce_shared(version, segment.handle, segment.num_bytes), backend, timeout_s=60)
    assert backend.version == version
    assert worst_logprob_gap(backend, learner) <= 1e-3
    # an adapter of another rank: refused before the engine sees it
    wrong = adapter_tensors(trained(model_dir, LoraConfig(rank=4, alpha=16.0), seed=7))
    other = SharedSegment([spec_of(n, t) for n, t in wrong], "cpu")
    other.write(version + 1, wrong)
    with pytest.raises(ValueError, match=f"weights v{version + 1} do not match"):
        backend.load_shared(other.handle, version + 1, timeout_s=60)
    assert backend.version == version
    assert worst_logprob_gap(backend, learner) <= 1e-3
    segment.close()
    other.close()


# Last: closing a second engine releases this process's distributed state, which the module's engine needs.
def test_an_adapter_on_the_output_head_is_served_too(model_dir, tmp_path):
    """The head's adapter (how the random tiny model learns to be sure, configs/quickstart-lora.yaml)."""
    engine = VllmBackend(str(model_dir), max_model_len=256, lora=HEAD)
    try:
        learner = trained(model_dir, HEAD, seed=5)
        FolderReceiver().receive(publish_adapter(learner, tmp_path, 1, model_dir), engine, timeout_s=60)
        judge = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "v000001")
        assert worst_logprob_gap(engine, judge.eval()) <= 1e-3
    finally:
        engine.close()
