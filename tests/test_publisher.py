"""Publishing a version, rank 0 alone: folders and served folders are announced by transport; a push lands whole."""

import threading
import time

import pytest
import torch
from conftest import ROOT, FakeClock, free_port, wait_for
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.weights import folders, push_sender
from asyncrl.weights.push import PushStats, WeightGroup
from asyncrl.weights.push_sender import PushSender
from asyncrl.weights.transports import folder_of
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
    """Stands in for the push group on rank 0: hosts no store; ``successor`` is what aborting a stuck push does.

    ``send`` raises each error of ``failures`` in turn, then lands.
    """

    def __init__(self, created, failures=()):
        self.aborted, self.created, self.failures, self.sent = False, created, list(failures), []
        created.append(self)

    def listen(self):
        pass

    def successor(self):
        self.aborted = True
        return StubGroup(self.created)

    def send(self, epoch, version, specs, tensors, bucket_bytes):
        self.sent.append(epoch)
        if self.failures:
            raise self.failures.pop(0)
        return PushStats(version, sum(s.num_bytes for s in specs), 1, 0.125)

    def close(self):
        pass


@pytest.fixture
def push_config(tmp_path):
    (tmp_path / "push.secret").write_text("s3cret\n")
    return [
        f"run_dir={tmp_path}",
        f"model.path={MODEL}",
        f"push.address=127.0.0.1:{free_port()}",
        f"push.secret_file={tmp_path / 'push.secret'}",
    ]


class Groups:
    """The push groups a sender opened, in order; the next one opened fails with ``failures`` first."""

    def __init__(self):
        self.created, self.failures = [], ()

    def open(self, *args):
        return StubGroup(self.created, self.failures)


@pytest.fixture
def groups(monkeypatch):
    """The push groups the sender opens, stubbed: no store, no broadcast."""
    groups = Groups()
    monkeypatch.setattr(push_sender, "open_group", groups.open)
    return groups


def test_a_generator_left_behind_gets_the_version_again_after_a_grace_with_doubling_backoff(
    model, tmp_path, monkeypatch, push_config, groups
):
    clock = FakeClock()
    pushes = []  # (epoch, version, retry) of each push started
    monkeypatch.setattr(
        PushSender,
        "_start_thread",
        lambda self, epoch, version, tensors, retry: pushes.append((epoch, version, retry)),
    )
    coordinator = Announcements()
    publisher = Publisher(load_config(None, push_config), model, coordinator, tmp_path / "weights", clock=clock)
    publisher.publish(3)
    [(first_epoch, _, _)] = pushes

    def seconds_to_next_push():
        waited, pushed = 0.0, len(pushes)
        while publisher.resend_if_lagging() and len(pushes) == pushed and waited < 600:
            clock.advance(0.5)
            waited += 0.5
        assert len(pushes) == pushed + 1, "no push while a generator is behind"
        return waited

    clock.advance(10)
    assert not publisher.resend_if_lagging()  # every generator holds v3
    coordinator.behind = ["gen-1"]
    # Two seconds to report the version at its next request, then 2, 4, 8 ... seconds apart, up to 300.
    assert [seconds_to_next_push() for _ in range(11)] == [2, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    repushes = pushes[1:]
    assert repushes == [(first_epoch + n, 3, False) for n in range(1, 12)], "each in a new group, sent once"
    assert [(u.epoch, u.version) for u in coordinator.updates] == [(first_epoch + n, 3) for n in range(12)]
    coordinator.behind = []
    clock.advance(1000)
    assert not publisher.resend_if_lagging() and len(pushes) == 12


def test_a_failed_background_push_is_announced_again_under_the_next_epoch_until_it_lands(
    model, tmp_path, push_config, groups
):
    groups.failures = [ConnectionError("a generator hung up"), TimeoutError("bucket 0 of v3")]
    coordinator = Announcements()
    publisher = Publisher(
        load_config(None, [*push_config, "push.timeout_s=0.05"]), model, coordinator, tmp_path / "weights"
    )
    publisher.publish(3)
    wait_for(lambda: publisher.last_push_s is not None)
    publisher.finish()
    first = coordinator.updates[0].epoch
    assert [(u.epoch, u.version) for u in coordinator.updates] == [(first, 3), (first + 1, 3), (first + 2, 3)]
    assert groups.created[0].sent == [first, first + 1, first + 2] and publisher.timings() == {"push_s": 0.125}
    publisher.publish(4)
    publisher.finish()
    assert coordinator.updates[-1].epoch == first + 2, "a push that landed keeps its group"


def test_a_newer_version_ends_the_retries_of_a_failed_push_without_waiting_out_the_backoff(
    model, tmp_path, push_config, groups
):
    groups.failures = [ConnectionError("a generator hung up")] * 2
    coordinator = Announcements()
    publisher = Publisher(  # the first retry would come after a second
        load_config(None, [*push_config, "push.timeout_s=30"]), model, coordinator, tmp_path / "weights"
    )
    publisher.publish(3)
    wait_for(lambda: groups.created[0].sent)
    started = time.monotonic()
    publisher.publish(4)  # stops the retries of v3 first
    publisher.finish()
    assert time.monotonic() - started < 0.9, "waited out the backoff"
    first = coordinator.updates[0].epoch
    # v3 failed and was not tried again; v4 went out in a new group, and the end of the run ended its retries.
    assert [(u.epoch, u.version) for u in coordinator.updates] == [(first, 3), (first + 1, 4)]
    assert groups.created[0].sent == [first, first + 1]


def test_finish_aborts_a_push_stuck_past_its_time_and_the_next_goes_out_in_a_new_group(
    model, tmp_path, monkeypatch, caplog, push_config, groups
):
    released, sent_with = threading.Event(), []

    def send(self, epoch, version, tensors, retry, group, stop):
        sent_with.append((epoch, group))
        released.wait(30)  # deaf to stop, as a broadcast blocked in a collective is

    monkeypatch.setattr(PushSender, "_send_in_background", send)
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
    assert groups.created == [first_group, next_group] and first_group.aborted and not next_group.aborted
    assert next_epoch == first_epoch + 1
