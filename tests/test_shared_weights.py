"""Shared-memory weight handover on one machine: the segment, its sequence lock, and a backend loading from it.

On CPU the segment is a /dev/shm file; the same code runs over CUDA IPC on a
GPU (tests/test_gpu_one_gpu_run.py).
"""

import stat
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import ROOT

from asyncrl.config import ConfigError, load_config, read_secret
from asyncrl.launch.preflight import run_config
from asyncrl.weights import shared
from asyncrl.weights.shared import SharedSegment, SharedView, Superseded, superseded
from asyncrl.weights.transports import announce_shared, transport_of
from asyncrl.wire import protocol
from asyncrl.wire.protocol import TensorSpec, WeightUpdate

TINY = ROOT / "assets" / "tiny-llama"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
    }


def _segment(state) -> SharedSegment:
    return SharedSegment(
        [TensorSpec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()], "cpu"
    )


def test_a_reader_gets_a_private_copy_of_the_announced_version():
    first, second = _state(0), _state(1)
    segment = _segment(first)
    segment.write(1, first.items())
    view = SharedView(segment.handle, "cpu")
    assert [s.name for s in view.specs] == list(first)
    got = dict(view.read(1, timeout_s=1.0))
    assert all(torch.equal(got[k], first[k]) and got[k].dtype == first[k].dtype for k in first)
    segment.write(2, second.items())
    assert torch.equal(got["a.weight"], first["a.weight"])  # the copy is the reader's own
    again = dict(view.read(2, timeout_s=1.0))
    assert torch.equal(again["b.bias"], second["b.bias"])
    segment.close()


def test_a_version_overwritten_while_it_is_copied_is_rejected():
    state = _state(0)
    segment = _segment(state)
    segment.write(1, state.items())
    view = SharedView(segment.handle, "cpu")
    real, calls = view.version, []

    def version() -> int:  # the learner writes v2 between the reader's two looks at the version word
        calls.append(1)
        if len(calls) == 2:
            segment.write(2, _state(1).items())
        return real()

    view.version = version
    with pytest.raises(Superseded, match="overwritten"):
        view.read(1, timeout_s=1.0)
    view.version = real
    with pytest.raises(Superseded, match="already holds v2"):
        view.read(1, timeout_s=1.0)
    with pytest.raises(ValueError, match="announced, but the segment holds v2"):
        view.read(3, timeout_s=1.0)
    segment.close()


def test_a_reader_racing_a_writer_accepts_only_whole_versions():
    # Version v fills every tensor with v; a copy taken while the writer runs must be uniform.
    specs = [TensorSpec(f"t{i}", "float32", (256, 1024)) for i in range(8)]
    segment = SharedSegment(specs, "cpu")
    segment.write(0, [(s.name, torch.zeros(s.shape)) for s in specs])
    view = SharedView(segment.handle, "cpu")
    stop, written = threading.Event(), []

    def writer() -> None:
        version = 0
        while not stop.is_set():
            version += 1
            segment.write(version, [(s.name, torch.full(s.shape, float(version))) for s in specs])
            written.append(version)

    thread = threading.Thread(target=writer)
    thread.start()
    accepted = rejected = 0
    try:
        while accepted + rejected < 300:
            held = view.version()
            if held == shared.WRITING:
                continue
            try:
                got = view.read(held, timeout_s=1.0)
            except Superseded:
                rejected += 1
                continue
            accepted += 1
            assert all(torch.all(t == float(held)) for _, t in got), f"a torn copy of v{held} was accepted"
    finally:
        stop.set()
        thread.join()
    assert accepted and rejected and len(written) > 10, (accepted, rejected, len(written))
    segment.close()


def test_a_half_written_version_is_waited_for_then_times_out():
    state = _state(0)
    segment = _segment(state)  # nothing written yet: the word says WRITING
    view = SharedView(segment.handle, "cpu")
    with pytest.raises(TimeoutError, match="still being written"):
        view.read(1, timeout_s=0.05)
    segment.close()


def test_the_learner_writes_exactly_the_manifest():
    state = _state(0)
    segment = _segment(state)
    with pytest.raises(ValueError, match="x.weight .* is not in its manifest"):
        segment.write(1, [("x.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"a.weight \(5, 3\) is not in its manifest"):
        segment.write(1, [("a.weight", torch.zeros(5, 3))])
    with pytest.raises(ValueError, match="lacks"):
        segment.write(1, [("a.weight", state["a.weight"])])
    segment.close()


def test_the_segment_file_is_private_and_removed_with_its_learner(tmp_path):
    segment = _segment(_state(0))
    path = Path(segment.handle.path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    segment.close()
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match="is gone"):
        SharedView(segment.handle, "cpu")
    # A learner killed before it could remove its own file: the next learner on the machine removes it,
    # and leaves the file of a learner that still runs (it holds a lock on it).
    orphan = path.parent / "asyncrl-weights-1-0000"
    orphan.write_bytes(b"x")
    running = _segment(_state(1))
    _segment(_state(0)).close()
    assert not orphan.exists() and Path(running.handle.path).exists()
    running.close()


def test_the_handle_travels_in_the_announcement():
    segment = _segment(_state(0))
    update = announce_shared(4, segment.handle, segment.num_bytes)
    decoded = protocol.decode(protocol.encode(update), WeightUpdate)
    assert decoded.transport == "shared" and decoded.shared == segment.handle and decoded.version == 4
    assert decoded.num_bytes == 3 * 5 * 4 + 7 * 2 + 4 * 8
    segment.close()
    cuda = protocol.SharedHandle(
        kind="cuda", nbytes=10, gpu_uuid="GPU-1", cuda_ipc=(0, b"h", 10, 0, b"r", 8, b"e", True)
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cuda), type=protocol.SharedHandle) == cuda


def test_superseded_is_recognised_after_another_layer_re_raises_it():
    assert superseded(RuntimeError(str(Superseded("weights v3: the segment already holds v4"))))
    assert not superseded(RuntimeError("weights v3 do not match the model"))


def test_the_transformers_backend_loads_a_shared_version_all_or_nothing():
    from generators.hf_backend import TransformersBackend

    backend = TransformersBackend(str(TINY))
    start = {k: v.clone() for k, v in backend.model.state_dict().items()}
    moved = {
        k: v + 0.5
        for k, v in start.items()
        if k != "lm_head.weight" or "lm_head.weight" in dict(backend.model.named_parameters())
    }
    segment = _segment(moved)
    segment.write(7, moved.items())
    backend.load_shared(segment.handle, 7, timeout_s=1.0)
    assert backend.version == 7
    now = backend.model.state_dict()
    assert all(torch.equal(now[k], moved[k]) for k in moved)
    # A segment of another model changes nothing.
    other = _segment(_state(0))
    other.write(8, _state(0).items())
    with pytest.raises(ValueError, match="do not match the model"):
        backend.load_shared(other.handle, 8, timeout_s=1.0)
    assert backend.version == 7 and all(torch.equal(backend.model.state_dict()[k], moved[k]) for k in moved)
    segment.close()
    other.close()


def test_one_gpu_shared_by_learner_and_generators_chooses_shared_weights():
    config = ROOT / "configs" / "quickstart.yaml"
    assert transport_of(load_config(config, ["--learner.devices=0", "--generator.devices=0"])) == "shared"
    assert transport_of(load_config(config, ["--learner.devices=0", "--generator.devices=1"])) == "folder"
    assert (
        transport_of(load_config(config, ["--learner.devices=0,1", "--generator.devices=0,1", "--learner.ranks=2"]))
        == "folder"
    )
    assert (
        transport_of(
            load_config(config, ["--learner.devices=0", "--generator.devices=0", "--learner.shared_weights=false"])
        )
        == "folder"
    )
    assert transport_of(load_config(config, ["--learner.shared_weights=true"])) == "shared"
    with pytest.raises(ConfigError, match="learner.shared_weights"):
        load_config(config, ["--learner.shared_weights=true", "--push.address=127.0.0.1:29500"])
    # Each generator must sit on the learner's one GPU, whole.
    assert (
        transport_of(
            load_config(
                config, ["--learner.devices=0", "--generator.devices=0,1", "--generator.vllm.tensor_parallel_size=2"]
            )
        )
        == "folder"
    )
    with pytest.raises(ConfigError, match=r"needs generator.vllm.tensor_parallel_size 1.*learner.shared_weights"):
        load_config(config, ["--learner.shared_weights=true", "--generator.vllm.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"needs the generators on the learner's GPU.*learner.shared_weights"):
        load_config(config, ["--learner.shared_weights=true", "--learner.devices=0", "--generator.devices=1"])


def test_the_shipped_gpu_configs_hand_weights_over_without_folders(tmp_path):
    # One GPU, shared by both roles: CUDA IPC. Two GPUs, one role each: NCCL push.
    assert transport_of(load_config(ROOT / "configs" / "arith-smollm2.yaml")) == "shared"
    config = str(ROOT / "configs" / "arith-smollm2-2gpu.yaml")
    with pytest.raises(ConfigError, match=r"push\.secret_file"):  # started by hand, it needs the run's secret
        read_secret(load_config(config).push)

    def as_asyncrl_run_loads(*overrides):
        return run_config(config, list(overrides))[0]

    two = as_asyncrl_run_loads(f"--run_dir={tmp_path}")
    assert transport_of(two) == "push" and two.learner.devices != two.generator.devices
    secret = tmp_path / "push.secret"
    assert two.push.secret_file == str(secret)
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) >= 32
    first = secret.read_text()
    as_asyncrl_run_loads(f"--run_dir={tmp_path}")
    assert secret.read_text() != first, "every run gets a fresh secret"
    with pytest.raises(ConfigError, match=r"push\.secret_file: cannot read .*mine"):  # read before anything starts
        as_asyncrl_run_loads(f"--run_dir={tmp_path / 'b'}", f"--push.secret_file={tmp_path / 'mine'}")
    (tmp_path / "mine").write_text("ours\n")
    given = as_asyncrl_run_loads(f"--run_dir={tmp_path / 'b'}", f"--push.secret_file={tmp_path / 'mine'}")
    assert given.push.secret_file == str(tmp_path / "mine") and not (tmp_path / "b" / "push.secret").exists()
    with pytest.raises(ConfigError, match=r"push\.secret_file"):  # beyond loopback the user gives it
        as_asyncrl_run_loads(f"--run_dir={tmp_path / 'c'}", "--push.address=10.1.2.3:29600")
