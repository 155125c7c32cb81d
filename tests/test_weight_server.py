"""Weights over ZeroMQ: a generator with no shared file system fetches what the learner published."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl import weights
from asyncrl.weight_server import CHUNK_BYTES, WeightServer, fetch
from asyncrl.weight_transport import folder_of
from conftest import ROOT

MODEL = ROOT / "assets/tiny-llama"


@pytest.fixture
def served(tmp_path, tcp_address):
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    # A tensor over one chunk, so the transfer takes several requests.
    state = dict(model.state_dict(), extra=torch.arange(CHUNK_BYTES // 4 + 10, dtype=torch.float32))
    update = weights.publish(state.items(), version=4, weights_dir=tmp_path / "learner", model_dir=MODEL,
                             config_json=model.config.to_json_string())
    server = WeightServer(tmp_path / "learner", tcp_address)
    yield update, tcp_address
    server.close()


def test_fetch_copies_the_whole_version(served, tmp_path):
    update, address = served
    fetched = fetch(4, address, tmp_path / "cache", timeout_s=10)
    source = folder_of(update)
    assert fetched.parent == tmp_path / "cache" and fetched != source
    for path in source.iterdir():
        assert (fetched / path.name).read_bytes() == path.read_bytes(), path.name
    assert torch.equal(weights.read_state_dict(fetched, 4)["extra"], weights.read_state_dict(source, 4)["extra"])


def test_missing_version_is_an_error_and_leaves_nothing(served, tmp_path):
    _, address = served
    with pytest.raises(FileNotFoundError, match="v9 is not published"):
        fetch(9, address, tmp_path / "cache", timeout_s=10)
    assert not any((tmp_path / "cache").iterdir())


def test_unreachable_server_times_out(tmp_path, tcp_address):
    with pytest.raises(TimeoutError, match="no answer"):
        fetch(1, tcp_address, tmp_path / "cache", timeout_s=0.3)


def _publish(tmp_path, version, state):
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    return weights.publish(state.items(), version=version, weights_dir=tmp_path / "learner", model_dir=MODEL,
                           config_json=model.config.to_json_string(), keep_versions=5)


@pytest.mark.parametrize("deltas", [True, False])
def test_a_generator_holding_a_version_fetches_only_the_difference(tmp_path, tcp_address, caplog, deltas):
    state = {k: v.bfloat16() for k, v in AutoModelForCausalLM.from_pretrained(MODEL).state_dict().items()}
    _publish(tmp_path, 1, state)
    moved = {k: (v.float() + 0.05 * (torch.rand_like(v.float()) < 0.1)).bfloat16() for k, v in state.items()}
    source = folder_of(_publish(tmp_path, 2, moved))
    server = WeightServer(tmp_path / "learner", tcp_address, deltas=deltas)
    try:
        fetch(1, tcp_address, tmp_path / "cache", timeout_s=10)
        with caplog.at_level("INFO", logger="asyncrl.weight_server"):
            fetched = fetch(2, tcp_address, tmp_path / "cache", timeout_s=10, base=1)
    finally:
        server.close()
    assert ("delta v1 -> v2" in caplog.text) == deltas
    got, want = weights.read_state_dict(fetched, 2), weights.read_state_dict(source, 2)
    assert got.keys() == want.keys() and all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16))
                                             for k in want)
    assert sorted(p.name for p in fetched.iterdir()) == sorted(p.name for p in source.iterdir())


def test_a_base_the_server_no_longer_has_gets_the_whole_version(served, tmp_path):
    _, address = served
    fetched = fetch(4, address, tmp_path / "cache", timeout_s=10, base=3)  # nothing held: whole
    assert (fetched / "model.safetensors").exists() and not (fetched / "model.safetensors.delta").exists()
