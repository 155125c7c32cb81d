"""Publishing a version, rank 0 alone: folders and served folders are announced by transport; a push lands whole."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl import weights
from asyncrl.config import load_config
from asyncrl.weight_sync import WeightGroup
from asyncrl.weight_transport import folder_of
from conftest import ROOT, free_port
from learners.publisher import Publisher

MODEL = ROOT / "assets/tiny-llama"


class Announcements:
    """Stands in for the coordinator: records what generators would be told."""

    def __init__(self):
        self.updates = []

    def publish(self, update):
        self.updates.append(update)

    def lagging(self):
        return []


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL)


@pytest.mark.parametrize("overrides, transport", [([], "folder"),
                                                  (["coordinator.weights_address=tcp://127.0.0.1:1"], "served")])
def test_a_folder_version_is_written_whole_then_announced(model, tmp_path, overrides, transport):
    config = load_config(None, [f"run_dir={tmp_path}", f"model.path={MODEL}", *overrides])
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, tmp_path / "weights")
    publisher.publish(5)
    (update,) = coordinator.updates
    assert (update.version, update.transport) == (5, transport)
    folder = tmp_path / "weights" / "v000005"
    if transport == "folder":
        assert folder_of(update) == folder.resolve()
    state = weights.read_state_dict(folder, 5)
    assert all(torch.equal(state[name], p.detach()) for name, p in model.named_parameters())


def test_a_background_push_arrives_whole_and_is_announced_by_epoch(model, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    config = load_config(None, [f"run_dir={tmp_path}", f"model.path={MODEL}", f"push.address={address}",
                                "push.generators=1", "push.timeout_s=20", "push.bucket_mb=1"])
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, tmp_path / "weights")
    received = []
    receiver = WeightGroup(address, 1, 2, "gloo", 20.0, "cpu")

    def receive():
        update = coordinator.updates[0]
        received.append(receiver.receive(update.epoch, update.version))

    publisher.publish(3)  # returns once announced: the broadcast runs on its own thread
    (update,) = coordinator.updates
    assert update.transport == "push" and update.version == 3 and update.num_bytes > 0
    thread = threading.Thread(target=receive)
    thread.start()
    thread.join(timeout=60)
    publisher.finish()
    manifest, tensors = received[0]
    assert manifest.version == 3 and publisher.last_push_s is not None
    got = dict(tensors)
    assert all(torch.equal(got[name], p.detach()) for name, p in model.named_parameters())
    assert not (tmp_path / "weights").exists(), "a push writes no folder"
