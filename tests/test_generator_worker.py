"""The generator loop against an in-process coordinator and buffer, with a scripted backend."""

import msgspec
import torch

from asyncrl import weights
from asyncrl.config import BufferConfig, RunConfig, load_config
from asyncrl.coordinator import Coordinator, PromptCursor
from asyncrl.protocol import WeightUpdate
from asyncrl.staleness import StalenessBound
from asyncrl.weight_transport import announce_push
from buffers import open_reader, open_writer
from conftest import ROOT
from generators.base import Sample
from generators.worker import GeneratorWorker


class DirectClient:
    """Calls the coordinator in process instead of over ZeroMQ."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.address = "inproc"

    def call(self, request, expected):
        return self.coordinator.handle_work(request)


class ScriptedBackend:
    """Yields one group at a time; ``v1`` (a real published folder) is announced while the second is sampled."""

    def __init__(self, coordinator: Coordinator, v1: WeightUpdate | None = None) -> None:
        self.coordinator = coordinator
        self.v1 = v1
        self.version = 0
        self.loaded: list[int] = []

    def generate(self, requests, params, between_steps=None):
        for k, request in enumerate(requests):
            yield request, [Sample([5, 2], [-0.1, -0.2], [self.version] * 2, "stop", "3") for _ in range(params.n)]
            if k == 0:
                self.coordinator.publish(self.v1)
            if k == len(requests) - 1:
                self.coordinator.stop()
            elif between_steps is not None:  # the engine steps on to the next group
                between_steps()

    def load_folder(self, folder, version, timeout_s):
        assert (folder / "model.safetensors").exists()
        self.loaded.append(version)
        self.version = version


def _run(update_in_flight: bool, tmp_path) -> tuple[list[list[int]], list[int]]:
    config = load_config(None, [f"--generator.update_in_flight={update_in_flight}", "--generator.update_poll_s=0",
                                "--generator.samples_per_prompt=2", "--generator.groups_per_request=3"])
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address=f"worker-{update_in_flight}", capacity=100)
    reader, writer = open_reader(buffer), open_writer(buffer)
    v1 = weights.publish([("w", torch.zeros(2))], version=1, weights_dir=tmp_path, model_dir=ROOT / "assets/tiny-llama",
                         config_json="{}")
    backend = ScriptedBackend(coordinator, v1)
    items = [{"prompt": "12=", "answer": "12"}] * 10
    worker = GeneratorWorker(config, "gen-0", backend, tokenize=lambda t: [1, 4, 5, 13], items=items,
                             reward_fn=lambda text, item: 1.0, client=DirectClient(coordinator), writer=writer)
    worker.run()
    rollouts = reader.get(max_items=100, timeout_s=1)
    return [r.versions for r in rollouts], backend.loaded


def test_update_lands_mid_batch_when_in_flight_updates_are_on(tmp_path):
    versions, loaded = _run(update_in_flight=True, tmp_path=tmp_path)
    assert loaded == [1]
    # v1 appears after group 0; the worker loads it at the next engine step, before group 1 is sampled.
    assert versions == [[0, 0]] * 2 + [[1, 1]] * 4


def test_update_waits_for_the_batch_when_off(tmp_path):
    versions, loaded = _run(update_in_flight=False, tmp_path=tmp_path)
    assert versions == [[0, 0]] * 6
    assert loaded == [1]  # applied before the next request


def test_config_round_trips_the_new_fields():
    config = load_config(None, ["--generator.update_in_flight=false"])
    assert msgspec.convert(msgspec.to_builtins(config), RunConfig).generator.update_in_flight is False


def test_a_failed_push_is_not_retried_until_the_next_one():
    """A push is a one-off broadcast: retrying its announcement would only wait out the timeout again."""
    config = load_config(None, ["push.address=127.0.0.1:29999"])
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    buffer = BufferConfig(type="inproc", address="worker-push", capacity=100)

    class FailingPushes(ScriptedBackend):
        def receive_push(self, epoch, version, timeout_s):
            self.loaded.append(version)
            raise TimeoutError("weight push: nobody sent it")

    backend = FailingPushes(coordinator)
    worker = GeneratorWorker(config, "gen-0", backend, tokenize=lambda t: [1], items=[{"prompt": "1"}],
                             reward_fn=lambda text, item: 1.0, client=DirectClient(coordinator),
                             writer=open_writer(buffer))
    for epoch, version in ((7, 1), (7, 1), (7, 1), (8, 2)):
        worker._maybe_update(announce_push(epoch, version, num_bytes=0))
    assert backend.loaded == [1, 2] and worker.failed_updates == 2
