"""learner: the attention kernel and Liger's kernels, as the config sets them."""

import importlib.util

import pytest

from asyncrl.config import load_config
from asyncrl.extras import MissingExtra
from learners.engine import _attention, use_liger


def test_by_default_rows_are_padded_under_transformers_default_attention_without_liger():
    learner = load_config(None).learner
    assert learner.pack_sequences is False and _attention(learner) == {}
    assert use_liger(learner) is False


def test_a_packed_run_names_its_attention_kernel():
    learner = load_config(None, ["--learner.pack_sequences=true",
                                 "--learner.attn_implementation=flex_attention"]).learner
    assert learner.pack_sequences is True and _attention(learner) == {"attn_implementation": "flex_attention"}


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_kernels_asked_for_but_not_installed_names_the_key():
    learner = load_config(None, ["--learner.liger_kernels=true"]).learner
    with pytest.raises(MissingExtra, match=r"learner.liger_kernels: true needs liger_kernel"):
        use_liger(learner)
