"""Publishing a version, rank 0 alone: folders and served folders are announced by transport; a push lands whole."""

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, free_port
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.weights import folders
from asyncrl.weights.push import WeightGroup
from asyncrl.weights.transports import folder_of
from learners import publisher as publisher_module
from learners.publisher import Publisher

MODEL = ROOT / "assets/tiny-llama"


class Announcements:
    """Stands in for the coordinator: records what generators would be told."""

    def __init__(self):
        self.updates = []
        self.behind = []  # generators that lack the latest version

    def publish(self, update):
        self.updates.append(update)

    def lagging(self):
        return list(self.behind)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL)


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize(
    "overrides, transport", [([], "folder"), (["coordinator.weights_address=tcp://127.0.0.1:1"], "served")]
)
def test_a_folder_version_is_written_whole_then_announced(model, tmp_path, overrides, transport, background):
    config = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            f"model.path={MODEL}",
            f"learner.background_publish={str(background).lower()}",
            *overrides,
        ],
    )
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, tmp_path / "weights")
    publisher.publish(5)
    publisher.finish()
    (update,) = coordinator.updates
    assert (update.version, update.transport) == (5, transport)
    folder = tmp_path / "weights" / "v000005"
    if transport == "folder":
        assert folder_of(update) == folder.resolve()
    state = folders.read_state_dict(folder, 5)
    assert all(torch.equal(state[name], p.detach()) for name, p in model.named_parameters())


def test_a_background_write_holds_the_weights_of_its_step_not_later_ones(tmp_path, monkeypatch):
    """The learner trains on while a version is written: the file must hold the weights it was published with."""
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    config = load_config(None, [f"run_dir={tmp_path}", f"model.path={MODEL}"])
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, tmp_path / "weights")
    published = {name: p.detach().clone() for name, p in model.named_parameters()}
    stepped, write = threading.Event(), folders.publish

    def slow_write(tensors, **kwargs):  # a write that is still going when the next step changes the weights
        assert stepped.wait(timeout=30)
        return write(tensors, **kwargs)

    monkeypatch.setattr(folders, "publish", slow_write)
    publisher.publish(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next optimizer step, in place
    stepped.set()
    publisher.publish(2)
    publisher.finish()
    assert [u.version for u in coordinator.updates] == [1, 2], "announced in order, each after its write"
    first = folders.read_state_dict(tmp_path / "weights" / "v000001", 1)
    second = folders.read_state_dict(tmp_path / "weights" / "v000002", 2)
    assert all(torch.equal(first[name], published[name]) for name in published)
    assert all(torch.equal(second[name], published[name] + 1.0) for name in published)
    assert publisher.last_write_s is not None


def test_a_failed_background_write_stops_the_learner_at_its_next_publish(model, tmp_path):
    blocker = tmp_path / "weights"
    blocker.write_text("a file where the weights folder should be")
    config = load_config(None, [f"run_dir={tmp_path}", f"model.path={MODEL}"])
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, blocker)
    publisher.publish(1)  # the write fails on its thread
    with pytest.raises(RuntimeError, match="publishing weights to .*weights failed"):
        publisher.publish(2)
    assert coordinator.updates == [], "nothing is announced that was not written"
    publisher.finish()  # the error was raised once; finishing afterwards is clean


def test_a_background_push_arrives_whole_and_is_announced_by_epoch(model, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    (tmp_path / "push.secret").write_text("s3cret\n")
    config = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            f"model.path={MODEL}",
            f"push.address={address}",
            f"push.secret_file={tmp_path / 'push.secret'}",
            "push.generators=1",
            "push.timeout_s=20",
            "push.bucket_mb=1",
        ],
    )
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, tmp_path / "weights")
    received = []
    receiver = WeightGroup(address, 1, 2, "gloo", 20.0, "cpu", secret="s3cret")

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


class StubGroup:
    """Stands in for the push group on rank 0: hosts no store; ``successor`` is what aborting a stuck push does."""

    def __init__(self, created):
        self.aborted, self.created = False, created
        created.append(self)

    def listen(self):
        pass

    def successor(self):
        self.aborted = True
        return StubGroup(self.created)


@pytest.fixture
def push_config(tmp_path):
    (tmp_path / "push.secret").write_text("s3cret\n")
    return [
        f"run_dir={tmp_path}",
        f"model.path={MODEL}",
        f"push.address=127.0.0.1:{free_port()}",
        f"push.secret_file={tmp_path / 'push.secret'}",
    ]


@pytest.fixture
def groups(monkeypatch):
    """The push groups the publisher opens, stubbed: no store, no broadcast."""
    created = []
    monkeypatch.setattr(publisher_module, "open_group", lambda *args: StubGroup(created))
    return created


def test_a_generator_left_behind_gets_the_version_again_after_a_grace_with_doubling_backoff(
    model, tmp_path, monkeypatch, push_config, groups
):
    clock = [1000.0]
    pushes = []  # (epoch, version, retry) of each push started
    monkeypatch.setattr(
        Publisher,
        "_start_push_thread",
        lambda self, epoch, version, specs, tensors, bucket_bytes, retry: pushes.append((epoch, version, retry)),
    )
    coordinator = Announcements()
    publisher = Publisher(load_config(None, push_config), model, coordinator, tmp_path / "weights")
    monkeypatch.setattr(publisher_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    publisher.publish(3)
    [(first_epoch, _, _)] = pushes

    def seconds_to_next_push():
        waited, pushed = 0.0, len(pushes)
        while publisher.repush_if_lagging() and len(pushes) == pushed and waited < 600:
            clock[0] += 0.5
            waited += 0.5
        assert len(pushes) == pushed + 1, "no push while a generator is behind"
        return waited

    clock[0] += 10
    assert not publisher.repush_if_lagging()  # every generator holds v3
    coordinator.behind = ["gen-1"]
    # Two seconds to report the version at its next request, then 2, 4, 8 ... seconds apart, up to 300.
    assert [seconds_to_next_push() for _ in range(11)] == [2, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    repushes = pushes[1:]
    assert repushes == [(first_epoch + n, 3, False) for n in range(1, 12)], "each in a new group, sent once"
    assert [(u.epoch, u.version) for u in coordinator.updates] == [(first_epoch + n, 3) for n in range(12)]
    coordinator.behind = []
    clock[0] += 1000
    assert not publisher.repush_if_lagging() and len(pushes) == 12


def test_finish_aborts_a_push_stuck_past_its_time_and_the_next_goes_out_in_a_new_group(
    model, tmp_path, monkeypatch, caplog, push_config, groups
):
    released, sent_with = threading.Event(), []

    def send(self, epoch, version, specs, tensors, bucket_bytes, *, background, retry, group, stop):
        sent_with.append((epoch, group))
        released.wait(30)  # deaf to stop, as a broadcast blocked in a collective is

    monkeypatch.setattr(Publisher, "_send", send)
    coordinator = Announcements()
    publisher = Publisher(
        load_config(None, [*push_config, "push.timeout_s=0.25"]), model, coordinator, tmp_path / "weights"
    )
    publisher.publish(3)
    try:
        publisher.finish()  # waits 4 x push.timeout_s
    finally:
        released.set()
    assert "weight push push-v3 still running after 1 s; aborting it" in caplog.text
    publisher.publish(4)
    publisher.finish()
    [(first_epoch, first_group), (next_epoch, next_group)] = sent_with
    assert groups == [first_group, next_group] and first_group.aborted and not next_group.aborted
    assert next_epoch == first_epoch + 1
