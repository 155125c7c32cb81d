"""The weight push group on gloo: buckets, round trips, failures, config rules."""

from __future__ import annotations

import multiprocessing as mp
import threading

import msgspec
import pytest
import torch
from conftest import free_port

from asyncrl.config import ConfigError, load_config, read_secret
from asyncrl.weights.push import TensorSpec, WeightGroup, layout, open_group, plan_buckets, spec_of


def _state() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    # An odd-sized bf16 tensor followed by fp32 ones: every tensor must still land aligned for its dtype.
    return [(f"layer{i}.weight", torch.randn(64 + i, 8, generator=g)) for i in range(6)] + [
        ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(3.0)),
        ("bias", torch.randn(5, generator=g)),
    ]


def _receive(address: str, rank: int, versions: list[int], queue, timeout_s: float = 30) -> None:
    group = WeightGroup(address, rank, 3, timeout_s=timeout_s)
    try:
        for version in versions:
            manifest, tensors = group.receive(0, version)
            # Plain values: torch's shared-memory hand-off would not outlive this process.
            queue.put(
                (
                    rank,
                    manifest.version,
                    [(n, str(t.dtype), tuple(t.shape), t.double().flatten().tolist()) for n, t in tensors],
                )
            )
    except Exception as error:  # noqa: BLE001  (reported to the test)
        queue.put((rank, "error", f"{type(error).__name__}: {error}"))


def test_plan_buckets_keeps_order_and_bounds_size():
    specs = [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate([8, 8, 32, 4, 4, 4])]
    # 32 + 32 bytes fill a bucket; 128 is larger than a bucket and goes alone; 3 x 16 share one.
    assert plan_buckets(specs, 64) == [[0, 1], [2], [3, 4, 5]]
    assert plan_buckets(specs, 10**6) == [[0, 1, 2, 3, 4, 5]]
    assert sum(plan_buckets(specs, 1), []) == list(range(6))  # every tensor alone when buckets are tiny
    # Offsets are 16-byte aligned whatever the sizes before them.
    odd = [TensorSpec("a", "bfloat16", (7,)), TensorSpec("b", "float32", (3,)), TensorSpec("c", "float64", (1,))]
    assert layout(odd, [0, 1, 2]) == ([0, 16, 32], 48)


def test_two_receivers_get_every_tensor_bit_exact():
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_receive, args=(address, rank, [5, 6], queue)) for rank in (1, 2)]
    for p in procs:
        p.start()
    sender = WeightGroup(address, 0, 3, timeout_s=30)
    state = _state()
    specs = [spec_of(n, t) for n, t in state]
    stats = sender.send(0, 5, specs, state, bucket_bytes=1024)
    assert stats.num_buckets == len(plan_buckets(specs, 1024)) > 2
    sender.send(0, 6, specs, state, bucket_bytes=10**6)
    got = [queue.get(timeout=60) for _ in range(4)]
    for p in procs:
        p.join(timeout=30)
    assert sorted((rank, version) for rank, version, _ in got) == [(1, 5), (1, 6), (2, 5), (2, 6)]
    for _, _, tensors in got:
        assert [n for n, *_ in tensors] == [n for n, _ in state]
        for (_, dtype, shape, values), (_, expected) in zip(tensors, state):
            assert (dtype, shape) == (str(expected.dtype), tuple(expected.shape))
            assert values == expected.double().flatten().tolist()
    sender.close()


def test_a_sender_that_dies_mid_push_delivers_nothing():
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_receive, args=(address, rank, [1], queue, 5)) for rank in (1, 2)]
    for p in procs:
        p.start()
    sender = WeightGroup(address, 0, 3, timeout_s=30)  # long enough for the receivers to start
    state = _state()

    def dies():
        yield from state[:3]
        raise RuntimeError("learner lost")

    with pytest.raises(RuntimeError, match="learner lost"):
        sender.send(0, 1, [spec_of(n, t) for n, t in state], dies(), bucket_bytes=512)
    got = [queue.get(timeout=60) for _ in range(2)]
    for p in procs:
        p.join(timeout=30)
    assert all(version == "error" and "TimeoutError" in detail for _, version, detail in got), got
    sender.close()


def test_manifest_mismatch_is_refused_before_sending():
    sender = WeightGroup(f"127.0.0.1:{free_port()}", 0, 1, timeout_s=5)  # a group of one: nobody to wait for
    state = _state()
    specs = [spec_of(n, t) for n, t in state]
    specs[2] = TensorSpec(specs[2].name, "float32", (1, 1))
    with pytest.raises(ValueError, match="manifest says"):
        sender.send(0, 1, specs, state)
    sender.close()


@pytest.mark.parametrize(
    "override, field",
    [
        (
            ["push.address=127.0.0.1:29500", "push.secret_file=s", "push.generators=2", "generator.push_rank=3"],
            "generator.push_rank",
        ),
        (["push.address=127.0.0.1:29500", "push.secret_file=s", "push.bucket_mb=0"], "push.bucket_mb"),
    ],
)
def test_push_config_is_checked(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, override)
    with pytest.raises(ValueError, match="HOST:PORT"):
        WeightGroup("nohost", 0, 2)


@pytest.mark.parametrize("command", ["learners.cli", "generators.cli"])
def test_a_process_that_pushes_will_not_start_without_the_secret(command, tmp_path):
    """The store listens on every interface, even for a loopback push.address: the learner and each generator
    say so in one line at start, where a config loaded for anything else (status, eval, a sweep) needs none."""
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("push: {address: '127.0.0.1:29500'}\n")
    assert load_config(config).push.secret_file is None
    out = subprocess.run([sys.executable, "-m", command, str(config)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "push.secret_file is required" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_an_unreadable_or_empty_secret_file_is_named(tmp_path):
    push = load_config(None, ["push.address=127.0.0.1:29500", f"push.secret_file={tmp_path / 'none'}"]).push
    with pytest.raises(ValueError, match=r"push\.secret_file: cannot read .*none"):
        read_secret(push)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"push\.secret_file: .*empty is empty"):
        read_secret(msgspec.structs.replace(push, secret_file=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match=r"push\.secret_file is required"):  # a PushConfig built in code, too
        read_secret(msgspec.structs.replace(push, secret_file=None))
    (tmp_path / "good").write_text("s3cret\n")
    assert read_secret(msgspec.structs.replace(push, secret_file=str(tmp_path / "good"))) == "s3cret"


def test_a_member_that_never_joins_is_a_timeout_not_a_hang():
    sender = WeightGroup(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=1.5)
    state = _state()
    with pytest.raises(TimeoutError, match="1 of 2 members"):
        sender.send(0, 1, [spec_of(n, t) for n, t in state], state)
    sender.close()


def test_a_member_without_the_secret_is_not_admitted():
    """The store is reachable from anywhere; the secret keys every rendezvous entry, so without it a
    process that connects counts into a group of its own and the real one never hears of it."""
    address = f"127.0.0.1:{free_port()}"
    sender = WeightGroup(address, 0, 2, timeout_s=1.5, secret="the run's")
    sender.listen()
    outsider = WeightGroup(address, 1, 2, timeout_s=1.5, secret="a guess")
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_error_of(outsider.receive, 0, 1)))
    thread.start()
    state = _state()
    with pytest.raises(TimeoutError, match="1 of 2 members"):
        sender.send(0, 1, [spec_of(n, t) for n, t in state], state)
    thread.join(timeout=30)
    assert outcome and isinstance(outcome[0], TimeoutError) and "1 of 2 members" in str(outcome[0]), outcome
    sender.close()
    outsider.close()


def test_errors_never_carry_the_secret():
    """torch's store names the keys it timed out on, and those start with the secret; logs get the errors."""
    group = WeightGroup(f"127.0.0.1:{free_port()}", 1, 2, timeout_s=1, secret="hunter2")
    redacted = group._redacted(TimeoutError("wait timeout after 1000ms, keys: /asyncrl-push/hunter2/0/members"))
    assert isinstance(redacted, TimeoutError) and "hunter2" not in str(redacted)
    assert "asyncrl-push/<push.secret_file>/0/members" in str(redacted)

    class Picky(Exception):
        def __init__(self, code, text):
            super().__init__(f"{code}: {text}")

    assert "hunter2" not in str(group._redacted(Picky(7, "key hunter2")))
    plain = ValueError("nothing secret")
    assert group._redacted(plain) is plain


def test_a_push_that_fails_at_its_first_collective_never_prints_the_secret():
    """NCCL connects at a group's first broadcast, fetching store keys that start with the secret; a peer
    gone by then makes the broadcast call itself raise, naming the key."""
    import traceback

    class Broken:
        def __init__(self, message):
            self.message = message

        def broadcast(self, tensor, root):
            raise RuntimeError(self.message)

    group = WeightGroup(f"127.0.0.1:{free_port()}", 1, 2, timeout_s=1, secret="hunter2")
    group._group, group.epoch = Broken("store->get('0') got error: wait timeout, keys: /asyncrl-push/hunter2/1/0"), 1
    error = _error_of(group.receive, 1, 1)
    assert isinstance(error, TimeoutError) and "manifest size" in str(error)
    assert "hunter2" not in "".join(traceback.format_exception(error)) and "<push.secret_file>" in str(error)
    assert group._group is None, "a failed push leaves the group, so the next one forms a new one"

    group._group, group.epoch = Broken("connection reset by peer"), 1
    error = _error_of(group.receive, 1, 1)
    assert isinstance(error.__cause__, RuntimeError), "an error without the secret keeps its cause"


def _error_of(call, *args) -> BaseException | None:
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001  (the test inspects it)
        return error
    return None


def test_zero3_shapes_come_from_ds_shape_even_for_scalars():
    partitioned = torch.empty(0)
    partitioned.ds_shape = ()
    assert spec_of("scale", partitioned).shape == ()
    partitioned.ds_shape = (4, 3)
    assert spec_of("w", partitioned) == TensorSpec("w", "float32", (4, 3))


def test_the_sender_holds_its_port_from_the_start_and_a_taken_one_is_named():
    import socket

    address = f"127.0.0.1:{free_port()}"
    sender = WeightGroup(address, 0, 2, timeout_s=5)
    sender.listen()  # before any receiver exists
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5):
        pass  # something listens there already
    with pytest.raises(ValueError, match=rf"push.address {address}: the learner cannot listen there"):
        WeightGroup(address, 0, 2, timeout_s=5).listen()
    sender.close()


def test_the_push_group_counts_every_worker_of_every_engine(tmp_path):
    """Two engines of tensor parallel size 2: the learner and four workers, the last of them rank 4."""
    (tmp_path / "s").write_text("secret")
    push = load_config(
        None, ["push.address=127.0.0.1:29500", f"push.secret_file={tmp_path / 's'}", "push.generators=2"]
    ).push
    assert open_group(push, 4, "cpu", ranks_per_engine=2).world_size == 5
    with pytest.raises(ValueError, match="rank 4 is outside a group of 3"):
        open_group(push, 4, "cpu")
