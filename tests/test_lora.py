"""LoRA: the learner's adapter travels alone, as a PEFT folder peft loads as it is, and generators copy it in place.

The learner and the generators each add a fresh adapter to the same base; a
version is the adapter's tensors only, named as peft saves them. These tests
use the tiny Llama on CPU and peft itself as the judge of the format.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, publish_adapter
from peft import PeftModel, get_peft_model_state_dict
from test_evaluation import eval_args
from transformers import AutoModelForCausalLM

from asyncrl.config import LoraConfig
from asyncrl.weights import folders
from asyncrl.weights.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    AdapterView,
    check_lora,
    vllm_max_lora_rank,
    with_adapter,
)
from generators.hf_backend import TransformersBackend
from learners.engine import AdapterOff, PolicyLogprobs

MODEL = str(ROOT / "assets/tiny-llama")
IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])


def base() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(MODEL).eval()


def trained_adapter(rank: int = 8, seed: int = 0):
    """A learner's peft model whose adapter has moved away from zero, as training moves it."""
    torch.manual_seed(seed)
    model = with_adapter(base(), LoraConfig(rank=rank))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def publish(model, tmp_path, version: int = 3):
    publish_adapter(model, tmp_path, version, MODEL)
    return folders.version_dir(tmp_path, version)


def test_only_the_adapter_trains_and_travels_named_as_peft_saves_it():
    model = with_adapter(base(), LoraConfig(rank=8))
    view = AdapterView(model)
    names = [name for name, _ in view.named_parameters()]
    assert sorted(names) == sorted(get_peft_model_state_dict(model))
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    # the published parameters are the model's own (ZeRO-3 gathers them), and nothing else trains
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in view.parameters()} == trainable
    adapter_bytes = sum(p.numel() for p in view.parameters())
    assert adapter_bytes < sum(p.numel() for p in model.parameters()) / 2


def test_the_adapters_dropout_is_off_under_disable_dropout_as_the_generators_sample():
    def noisy(disable_dropout: bool) -> bool:
        torch.manual_seed(0)
        model = with_adapter(base(), LoraConfig(rank=4, dropout=0.5), disable_dropout).train()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:  # a trained adapter: a fresh one adds nothing, dropped out or not
                    parameter.normal_(0.0, 0.5)
            return not torch.equal(model(IDS).logits, model(IDS).logits)  # two train-mode passes

    assert not noisy(disable_dropout=True) and noisy(disable_dropout=False)


def test_a_published_version_is_a_peft_folder_that_peft_and_the_generator_load(tmp_path):
    learner = trained_adapter()
    folder = publish(learner, tmp_path)
    assert (folder / ADAPTER_FILE).exists() and (folder / ADAPTER_CONFIG).exists()
    assert not (folder / "model.safetensors").exists()  # the base never travels
    expected = logits(learner)
    assert not torch.allclose(expected, logits(base()), atol=1e-3)  # the adapter changes the model
    assert torch.allclose(logits(PeftModel.from_pretrained(base(), folder)), expected, atol=1e-5)

    generator = TransformersBackend(MODEL, lora=LoraConfig(rank=8))
    assert torch.allclose(logits(generator.model), logits(base()), atol=1e-6)  # version 0: the base itself
    generator.load_folder(folder, 3, timeout_s=30)
    assert generator.version == 3
    assert torch.allclose(logits(generator.model), expected, atol=1e-5)


def test_an_adapter_of_another_shape_is_refused_and_changes_nothing(tmp_path):
    folder = publish(trained_adapter(rank=4), tmp_path)
    generator = TransformersBackend(MODEL, lora=LoraConfig(rank=8))
    before = logits(generator.model)
    with pytest.raises(ValueError, match="weights v3 do not match the model"):
        generator.load_folder(folder, 3, timeout_s=30)
    assert generator.version == 0 and torch.equal(logits(generator.model), before)


def test_the_reference_of_a_lora_learner_is_its_base_with_the_adapter_off():
    learner = trained_adapter()
    policy = PolicyLogprobs(learner.get_base_model(), chunk_tokens=64)
    targets = torch.roll(IDS, -1, dims=1)
    with torch.no_grad():
        with_adapter_on, _ = policy(IDS, torch.ones_like(IDS), targets)
        plain, _ = PolicyLogprobs(base(), chunk_tokens=64)(IDS, torch.ones_like(IDS), targets)
    reference, _ = AdapterOff(policy, learner)(IDS, torch.ones_like(IDS), targets)
    assert torch.allclose(reference, plain, atol=1e-6)
    assert not torch.allclose(with_adapter_on, plain, atol=1e-3)
    # and the adapter is on again after it
    with torch.no_grad():
        again, _ = policy(IDS, torch.ones_like(IDS), targets)
    assert torch.equal(again, with_adapter_on)


@pytest.mark.parametrize(
    ("lora", "backend", "says"),
    [
        (LoraConfig(rank=1024), "vllm", r"learner.lora.rank: 1024 is above the largest .* \(512\)"),
        (LoraConfig(rank=-1), "transformers", "learner.lora.rank: -1"),
        (LoraConfig(rank=8, target_modules=["qkv"]), "transformers", "learner.lora.target_modules: "),
    ],
)
def test_a_lora_config_that_cannot_run_fails_naming_the_key(lora, backend, says):
    with pytest.raises(ValueError, match=says):
        check_lora(lora, backend, MODEL)


def test_vllm_is_sized_for_the_smallest_rank_that_holds_the_adapter():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    check_lora(LoraConfig(rank=0, target_modules=["nothing"]), "vllm", MODEL)  # off: nothing to check


def test_asyncrl_eval_takes_an_adapter_folder_on_its_runs_base(tmp_path, capsys):
    import json

    from generators.evaluate import main

    folder = publish(trained_adapter(), tmp_path / "weights", version=7)
    common = eval_args(folder, tmp_path)
    assert main(common) == 2  # the run's config must say it trains an adapter
    assert "a LoRA adapter folder: evaluate it with its run's config (learner.lora set)" in capsys.readouterr().err

    assert main([*common, "--learner.lora.rank=8", f"--model.path={MODEL}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompts"] == 5
    traces = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]
    assert {t["version"] for t in traces} == {1}  # sampled with the adapter loaded, not the bare base
