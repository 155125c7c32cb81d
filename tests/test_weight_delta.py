"""Lossless weight deltas: exact round trips, refusals, and the size of a typical update."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.weights import delta


def _save(path, tensors):
    save_file(tensors, str(path))
    return path


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def versions(tmp_path):
    torch.manual_seed(0)
    master = {"w": torch.randn(512, 256) * 0.02, "norm": torch.ones(256), "step": torch.tensor([7])}
    old = {"w": master["w"].bfloat16(), "norm": master["norm"], "step": master["step"]}
    # An Adam-sized step (1e-5 on weights near 0.02): most bf16 values do not change at all.
    moved = master["w"] + 1e-5 * torch.sign(torch.randn_like(master["w"]))
    new = {"w": moved.bfloat16(), "norm": master["norm"] * 1.001, "step": torch.tensor([8])}
    return _save(tmp_path / "old.safetensors", old), _save(tmp_path / "new.safetensors", new)


def test_base_xor_delta_is_the_new_version_bit_for_bit_and_much_smaller(versions, tmp_path):
    old, new = versions
    data = delta.encode(old, new, base=3, version=4)
    header = delta.apply(old, data, tmp_path / "out.safetensors", {"asyncrl_version": "4"})
    assert (header.base, header.version) == (3, 4)
    got, want = load_file(str(tmp_path / "out.safetensors")), load_file(str(new))
    assert got.keys() == want.keys() and all(_bits_equal(got[k], want[k]) for k in want)
    changed = (load_file(str(old))["w"].view(torch.int16) != want["w"].view(torch.int16)).float().mean()
    assert 0.05 < changed < 0.5  # the step moved some bf16 values (a quarter here), not most
    assert len(data) < 0.25 * new.stat().st_size


def test_a_delta_applied_to_another_base_is_refused(versions, tmp_path):
    old, new = versions
    data = delta.encode(old, new, base=3, version=4)
    with pytest.raises(ValueError, match="digest"):
        delta.apply(new, data, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_versions_of_different_models_have_no_delta(versions, tmp_path):
    old, _ = versions
    other = _save(tmp_path / "other.safetensors", {"w": torch.zeros(4, 4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="different tensors"):
        delta.encode(old, other, base=1, version=2)


@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 5)], ids=["scalar", "one", "empty", "matrix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool], ids=str)
def test_every_shape_and_dtype_round_trips_bit_for_bit(tmp_path, shape, dtype):
    """Learnable scalars (a logit scale, a temperature) and empty buffers travel as deltas too."""
    torch.manual_seed(1)
    before, after = (torch.randn(shape).to(dtype) for _ in range(2))
    old = _save(tmp_path / "old.safetensors", {"t": before, "w": torch.zeros(4, dtype=torch.bfloat16)})
    new = _save(tmp_path / "new.safetensors", {"t": after, "w": torch.ones(4, dtype=torch.bfloat16)})
    delta.apply(old, delta.encode(old, new, base=1, version=2), tmp_path / "out.safetensors")
    got, want = load_file(str(tmp_path / "out.safetensors")), load_file(str(new))
    assert got["t"].shape == shape and all(_bits_equal(got[k], want[k]) for k in want)
