"""learner: packing, attention kernel and Liger kernels, with the hardware deciding what the config leaves unset."""

import importlib.util

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.extras import MissingExtra
from learners.engine import _attention, use_liger


def test_on_a_gpu_rollouts_are_packed_under_flex_attention(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    learner = load_config(None).learner
    assert learner.packs() is True
    assert _attention(learner) == {"attn_implementation": "flex_attention"}, "block-sparse masks between rollouts"


def test_on_a_cpu_rows_are_padded_under_transformers_default_attention(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    learner = load_config(None).learner
    assert learner.packs() is False, "sdpa's packed mask is quadratic in the row: padded rows are faster on CPU"
    assert _attention(learner) == {}
    assert use_liger(learner) is False, "Liger's kernels are Triton: GPU only"


def test_what_the_config_sets_wins_over_the_hardware(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    learner = load_config(None, ["--learner.pack_sequences=false", "--learner.liger_kernels=false"]).learner
    assert learner.packs() is False and _attention(learner) == {}, "padded rows keep transformers' default"
    assert use_liger(learner) is False
    learner = load_config(None, ["--learner.attn_implementation=sdpa"]).learner
    assert learner.packs() is True and _attention(learner) == {"attn_implementation": "sdpa"}


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_kernels_asked_for_but_not_installed_names_the_key():
    learner = load_config(None, ["--learner.liger_kernels=true"]).learner
    with pytest.raises(MissingExtra, match=r"learner.liger_kernels: true needs liger_kernel"):
        use_liger(learner)
