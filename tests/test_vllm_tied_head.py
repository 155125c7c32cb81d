"""A tied output head (the input embedding as the head: SmolLM2, small Qwens) on the vLLM backend across updates.

Its own engine, in its own module: one process holds one vLLM engine at a time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402
from test_vllm_backend import assert_logprobs_match, base_state, load  # noqa: E402

from asyncrl.launch import tiny_model  # noqa: E402
from asyncrl.weights import folders  # noqa: E402
from generators.vllm_backend import VllmBackend  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_tied_output_head_follows_every_update(tmp_path_factory):
    """A model whose output head is its input embedding (SmolLM2, small Qwens) samples from the new embedding
    after each in-place reload, as head and embedding: on vLLM's CPU build the head keeps a packed copy of the
    weight for its GEMM, which a reload that names no head weight would leave at the first version's."""
    model_dir = tiny_model.build(tmp_path_factory.mktemp("tied") / "model", tied=True)
    assert "lm_head.weight" not in base_state(model_dir)
    weights_dir = tmp_path_factory.mktemp("tied-weights")
    engine = VllmBackend(str(model_dir), max_model_len=256)
    try:
        other = load_file(
            tiny_model.build(tmp_path_factory.mktemp("tied1") / "model", seed=1, tied=True) / "model.safetensors"
        )
        for state in (other, base_state(model_dir), other):  # every reload, not only the first
            version = load(engine, model_dir, weights_dir, state)
            assert_logprobs_match(engine, folders.version_dir(weights_dir, version))
    finally:
        engine.close()
