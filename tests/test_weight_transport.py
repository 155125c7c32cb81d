"""One transport per run, chosen from the config; receivers verify, then load all or nothing."""

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch
from conftest import ROOT

from asyncrl.config import load_config
from asyncrl.weights import folders
from asyncrl.weights.served import DELTA_NAME, WEIGHTS_FILE, WeightServer
from asyncrl.weights.transports import (
    FolderReceiver,
    PushReceiver,
    ServedReceiver,
    SharedReceiver,
    announce_folder,
    announce_push,
    open_receiver,
    transport_of,
)
from asyncrl.wire.protocol import WeightUpdate

CONFIG = str(ROOT / "configs/ci-tiny.yaml")


class RecordingBackend:
    version = 0

    def __init__(self):
        self.calls = []

    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        self.calls.append(("folder", folder, version))
        self.version = version

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        self.calls.append(("push", epoch, version))
        self.version = version


@pytest.mark.parametrize(
    "overrides, transport, receiver",
    [
        ([], "folder", FolderReceiver),
        (["coordinator.weights_address=tcp://127.0.0.1:5599"], "served", ServedReceiver),
        (["push.address=127.0.0.1:5600", "push.secret_file=push.secret"], "push", PushReceiver),
    ],
)
def test_the_config_alone_chooses_the_transport(overrides, transport, receiver):
    config = load_config(CONFIG, overrides)
    assert transport_of(config) == transport
    assert isinstance(open_receiver(config, "gen-0"), receiver)


def published(tmp_path, version=3):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    return folders.publish(
        state.items(),
        version=version,
        weights_dir=tmp_path / "w",
        model_dir=ROOT / "assets/tiny-llama",
        config_json="{}",
    )


def test_a_folder_is_verified_before_the_backend_sees_it(tmp_path):
    backend = RecordingBackend()
    update = announce_folder(published(tmp_path), "folder")
    receiver = FolderReceiver()
    assert receiver.wants(update, serving=("", 0)) and not receiver.wants(update, serving=("", 3))
    receiver.receive(update, backend, timeout_s=5)
    assert backend.calls == [("folder", tmp_path / "w" / "v000003", 3)]
    (tmp_path / "w" / "v000003" / "model.safetensors").unlink()  # pruned before we got to it
    with pytest.raises(FileNotFoundError, match="v3.*model.safetensors is missing"):
        receiver.receive(update, backend, timeout_s=5)
    assert len(backend.calls) == 1


def test_a_served_version_is_fetched_then_loaded_from_the_local_copy(tmp_path, tcp_address):
    backend = RecordingBackend()
    update = announce_folder(published(tmp_path, 4), "served")
    assert update.transport == "served" and update.uri == ""  # the learner's path means nothing elsewhere
    server = WeightServer(tmp_path / "w", tcp_address)
    try:
        ServedReceiver(tcp_address, tmp_path / "cache", None).receive(update, backend, timeout_s=10)
    finally:
        server.close()
    kind, folder, version = backend.calls[0]
    assert (kind, version) == ("folder", 4) and folder.parent == tmp_path / "cache"
    assert torch.equal(folders.read_state_dict(folder, 4)["w"], torch.arange(6.0).reshape(2, 3))


def test_each_push_is_joined_once_even_for_a_version_already_held():
    backend, receiver = RecordingBackend(), PushReceiver()
    first = announce_push(epoch=7, version=2, num_bytes=10)
    receiver.receive(first, backend, timeout_s=5)
    assert not receiver.wants(first, serving=("", 2))
    again = announce_push(epoch=8, version=2, num_bytes=10)  # re-pushed for a generator that missed it
    assert receiver.wants(again, serving=("", 2))
    receiver.receive(again, backend, timeout_s=5)
    assert backend.calls == [("push", 7, 2), ("push", 8, 2)]
    # A resumed learner starts its push group's epochs again: its epoch 7 is another push than the first's.
    assert receiver.wants(msgspec.structs.replace(first, session="resumed"), serving=("", 2))


@pytest.mark.parametrize(
    "receiver", [FolderReceiver(), SharedReceiver(), ServedReceiver("tcp://127.0.0.1:1", Path("/nonexistent"), None)]
)
def test_the_same_version_number_from_a_resumed_learner_is_loaded_again(receiver):
    # A learner resumed from a checkpoint numbers on from it: its v3 is other weights than the v3 a generator
    # loaded from the learner before the restart, so the number alone does not say "already serving".
    before, after = WeightUpdate(version=3, session="a"), WeightUpdate(version=3, session="b")
    assert not receiver.wants(before, serving=before.identity)
    assert receiver.wants(after, serving=before.identity)


class RecordingServer(WeightServer):
    """Records which of the weights' two forms each chunk request asks for, and from which held version."""

    def __init__(self, *args, **kwargs):
        self.asked = []
        super().__init__(*args, **kwargs)

    def _answer(self, request, final=True):
        if request.name in (WEIGHTS_FILE, DELTA_NAME) and (request.base, request.name) not in self.asked:
            self.asked.append((request.base, request.name))
        return super()._answer(request, final)


def test_a_delta_that_does_not_apply_is_followed_by_the_whole_version(tmp_path, tcp_address, caplog):
    def publish(version, w):
        return announce_folder(
            folders.publish(
                [("w", w)],
                version=version,
                weights_dir=tmp_path / "w",
                model_dir=ROOT / "assets/tiny-llama",
                config_json="{}",
            ),
            "served",
        )

    before = torch.arange(4096.0).reshape(64, 64)
    after = before.clone()
    after[0, 0] = -1.0  # one weight changed: a delta far smaller than the file
    backend = RecordingBackend()
    receiver = ServedReceiver(tcp_address, tmp_path / "cache", None)
    server = RecordingServer(tmp_path / "w", tcp_address)
    try:
        receiver.receive(publish(4, before), backend, timeout_s=10)
        held = tmp_path / "cache" / "v000004" / "model.safetensors"
        # The held copy is no longer what v4 was (a disk fault, a hand edit): the delta from it cannot apply.
        safetensors.torch.save_file({"w": torch.zeros(64, 64)}, held, metadata={"asyncrl_version": "4"})
        update = publish(5, after)
        server.asked.clear()
        receiver.receive(update, backend, timeout_s=10)
    finally:
        server.close()
    assert "weights v5: the delta from v4 failed" in caplog.text
    # The delta alone first, then the whole file alone: never both for one try.
    assert server.asked == [(4, DELTA_NAME), (-1, WEIGHTS_FILE)]
    assert [call[2] for call in backend.calls] == [4, 5] and receiver.held == 5
    assert torch.equal(folders.read_state_dict(backend.calls[1][1], 5)["w"], after)


def test_a_transport_other_than_the_configured_one_is_refused_by_name(tmp_path):
    backend = RecordingBackend()
    with pytest.raises(ValueError, match="travel by 'push' but this generator is set up for 'folder'"):
        FolderReceiver().receive(announce_push(1, 1, 0), backend, timeout_s=5)
    with pytest.raises(ValueError, match="expected a file:// folder"):
        FolderReceiver().receive(WeightUpdate(version=1, uri="zmq:v000001"), backend, timeout_s=5)
    assert backend.calls == []


def test_a_folder_whose_path_a_uri_escapes_is_found(tmp_path):
    # A sweep's run dirs look like runs/max_staleness=2 x/seed0: "=", " " and "%" are escaped in a file:// URI.
    root = tmp_path / "max_staleness=2 tis%"
    backend = RecordingBackend()
    update = announce_folder(published(root), "folder")
    assert "%3D" in update.uri and "%20" in update.uri
    FolderReceiver().receive(update, backend, timeout_s=5)
    assert backend.calls == [("folder", root / "w" / "v000003", 3)]


def test_a_served_cache_is_the_generators_own_and_a_killed_ones_is_swept(tmp_path, monkeypatch):
    # Two runs on one machine with the same generator id once shared one cache and deleted each other's
    # fetches; a generator killed before its exit left two versions of the model in it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    left = tmp_path / f"asyncrl-fetched-gen-0-{socket.gethostname()}-{killed.pid}"
    (left / "v000003").mkdir(parents=True)
    config = load_config(CONFIG, ["--coordinator.weights_address=tcp://127.0.0.1:5999"])
    receiver = open_receiver(config, "gen-0")
    assert receiver.cache_dir == tmp_path / f"asyncrl-fetched-gen-0-{socket.gethostname()}-{os.getpid()}"
    assert not left.exists()


def test_a_delta_evicted_between_its_offer_and_its_chunks_is_followed_by_the_whole_version(
    tmp_path, tcp_address, caplog
):
    class EvictingServer(RecordingServer):
        """Other pairs' deltas push this one out of the cache right after the file list offered it."""

        def _answer(self, request, final=True):
            if request.name == DELTA_NAME:
                with self._lock:
                    self._ready.clear()
            return super()._answer(request, final)

    before = torch.arange(4096.0).reshape(64, 64)
    after = before.clone()
    after[0, 0] = -1.0
    backend = RecordingBackend()
    receiver = ServedReceiver(tcp_address, tmp_path / "cache", None)
    server = EvictingServer(tmp_path / "w", tcp_address)
    try:
        for version, w in ((4, before), (5, after)):
            update = folders.publish(
                [("w", w)],
                version=version,
                weights_dir=tmp_path / "w",
                model_dir=ROOT / "assets/tiny-llama",
                config_json="{}",
            )
            server.asked.clear()
            receiver.receive(announce_folder(update, "served"), backend, timeout_s=10)
    finally:
        server.close()
    assert "the delta from v4 failed" in caplog.text and "no longer held" in caplog.text
    assert server.asked == [(4, DELTA_NAME), (-1, WEIGHTS_FILE)]
    assert [call[2] for call in backend.calls] == [4, 5]
    assert torch.equal(folders.read_state_dict(backend.calls[1][1], 5)["w"], after)


def test_a_lora_learners_adapter_versions_travel_served_whole_to_a_generator(tmp_path, tcp_address):
    """Served over the network, a LoRA version is its PEFT folder: the adapter's files, fetched whole (a delta is
    made of model.safetensors alone; an adapter is a few megabytes), and the generator loads them as written."""
    from conftest import publish_adapter
    from transformers import AutoModelForCausalLM

    from asyncrl.config import LoraConfig
    from asyncrl.weights.adapters import ADAPTER_CONFIG, ADAPTER_FILE, with_adapter

    model_dir = ROOT / "assets/tiny-llama"
    learner = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(rank=4))
    backend = RecordingBackend()
    receiver = ServedReceiver(tcp_address, tmp_path / "cache", None)
    server = RecordingServer(tmp_path / "w", tcp_address)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for name, param in learner.named_parameters():
                    if "lora_B" in name:
                        param.add_(0.01 * version)
            update = publish_adapter(learner, tmp_path / "w", version, model_dir)
            receiver.receive(announce_folder(update, "served"), backend, timeout_s=10)
            fetched, published = backend.calls[-1][1], folders.version_dir(tmp_path / "w", version)
            assert sorted(p.name for p in fetched.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG])
            for name in (ADAPTER_FILE, ADAPTER_CONFIG):
                assert (fetched / name).read_bytes() == (published / name).read_bytes()
    finally:
        server.close()
    assert [call[2] for call in backend.calls] == [1, 2]
    assert server.asked == [], "no model.safetensors and no delta of one was asked for"
