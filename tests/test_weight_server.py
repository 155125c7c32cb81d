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
