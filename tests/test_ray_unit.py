"""The ``--ray`` driver's bookkeeping against a stand-in for Ray: restarts counted by actor pid, permanent
deaths, actors never placed, refused scale requests, stop results, and resuming only this run's checkpoint.

The real thing, on a local Ray instance, is in test_ray.py (slow).
"""

import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from conftest import ROOT, FakeClock  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.launch import preflight  # noqa: E402
from asyncrl.launch.ray import driver  # noqa: E402
from asyncrl.launch.ray.learner_group import LearnerGroup  # noqa: E402
from asyncrl.launch.ray.pool import GeneratorPool, apply_request  # noqa: E402
from asyncrl.launch.ray.scaling import ScaleRequest, read_pool  # noqa: E402
from asyncrl.launch.ray.spec import RunSpec, stop_hosts  # noqa: E402


class Ref:
    """An answer of a fake actor call: a value, an exception, or never (``pending``)."""

    def __init__(self, value=None, exc: Exception | None = None, pending: bool = False) -> None:
        self.value, self.exc, self.pending = value, exc, pending


class Method:
    def __init__(self, answers) -> None:
        self.answers = answers

    def remote(self, *args):
        return next(self.answers) if not callable(self.answers) else self.answers(*args)


class Host:
    """A generator actor whose info() calls answer from a script."""

    def __init__(self, infos) -> None:
        self.info = Method(iter(infos))
        self.stop = Method(lambda grace_s, terminate: Ref(0))
        self.killed = False


def _info(actor_pid: int, returncode=None) -> Ref:
    return Ref(
        {
            "node": "10.0.0.1",
            "host": "h",
            "actor_pid": actor_pid,
            "pid": actor_pid + 1000,
            "restarted": False,
            "returncode": returncode,
        }
    )


@pytest.fixture
def fake_ray(monkeypatch):
    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if not r.pending]
        return ready, [r for r in refs if r.pending]

    def get(ref, timeout=None):
        if ref.exc is not None:
            raise ref.exc
        return ref.value

    killed = []
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda host, no_restart=True: killed.append(host))
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    return killed


def _spec(tmp_path: Path, *overrides: str) -> RunSpec:
    spec = RunSpec.__new__(RunSpec)
    spec.config = load_config(None, [f"--run_dir={tmp_path}", *overrides])
    spec.out, spec.tag, spec.base, spec.cwd = tmp_path, "t", [], str(tmp_path)
    spec.generator_gpus = spec.learner_gpus = 0
    spec.local_generators, spec.pin = True, {}
    (tmp_path / "ray").mkdir(parents=True)
    return spec


def _pool(spec: RunSpec, hosts: list[Host], clock: FakeClock | None = None) -> GeneratorPool:
    queue = iter(hosts)
    spec.cls = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda *args: next(queue)))
    pool = GeneratorPool(spec, "gcs", clock=clock or FakeClock())
    pool.scale(len(hosts))
    return pool


def test_a_restart_is_counted_from_a_new_actor_pid_and_a_dead_actor_is_dropped(tmp_path, fake_ray):
    unavailable = ray.exceptions.ActorUnavailableError("restarting", None)
    host = Host(
        [
            _info(100),
            _info(101),  # restarted between two calls, none of them in flight
            Ref(exc=unavailable),
            _info(102),  # a call in flight when it died
            Ref(exc=ray.exceptions.ActorDiedError()),
        ]
    )  # out of restarts, or its constructor failed
    pool = _pool(_spec(tmp_path, "--ray.max_restarts=-1"), [host])
    g = pool.state.generators["gen-0"]
    states = []
    for _ in range(5):
        pool.poll()
        states.append((g.state, g.restarts))
    assert states == [("running", 0), ("running", 1), ("restarting", 1), ("running", 2), ("dead", 2)]
    assert "its actor is dead" in g.reason and 0 not in pool.hosts
    assert "its actor is dead" in pool.all_dead()


def test_a_generator_never_placed_is_reported_with_what_the_cluster_has(tmp_path, fake_ray):
    clock = FakeClock()
    pool = _pool(_spec(tmp_path, "--ray.start_timeout_s=5"), [Host(itertools.repeat(Ref(pending=True)))], clock)
    pool.poll()
    clock.advance(5)
    pool.poll()
    assert pool.state.generators["gen-0"].state == "starting", "within ray.start_timeout_s: still waited for"
    clock.advance(1)
    pool.poll()
    g = pool.state.generators["gen-0"]
    assert g.state == "dead" and "not placed within ray.start_timeout_s" in g.reason and "available" in g.reason
    assert pool.state.error == g.reason, "asyncrl scale, waiting for it, says why"
    assert fake_ray, "its actor is removed"


def test_a_scale_request_is_refused_with_push_address_or_beyond_the_cluster(tmp_path, fake_ray):
    spec = _spec(
        tmp_path,
        "--push.address=127.0.0.1:29500",
        "--push.secret_file=s",
        "--push.generators=1",
        "--generator.replicas=1",
    )
    pool = _pool(spec, [Host(itertools.repeat(_info(100)))])
    apply_request(ScaleRequest(generators=3, request_id="r1"), spec, pool, local=True)
    assert pool.state.applied_request == "r1" and "cannot be scaled" in pool.state.error
    assert read_pool(tmp_path).error == pool.state.error

    spec = _spec(tmp_path / "two", "--ray.generator_cpus=4")
    pool = _pool(spec, [])
    apply_request(ScaleRequest(generators=3, request_id="r2"), spec, pool, local=True)
    assert "needs 13 CPUs" in pool.state.error and "ray.local_cpus" in pool.state.error
    assert pool.state.target == 0


def test_gpus_the_cluster_lacks_are_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    spec = _spec(tmp_path, "--generator.replicas=2")
    spec.learner_gpus = spec.generator_gpus = 1
    with pytest.raises(RuntimeError, match=r"needs 3 GPUs.*ray.learner_gpus=0.5"):
        spec.check_resources(2, local=True)
    spec.learner_gpus = spec.generator_gpus = 0.33
    spec.check_resources(2, local=True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})  # fractions of no GPU: not the way out
    with pytest.raises(
        RuntimeError, match=r"has 0: it has no GPU: leave ray.learner_gpus and ray.generator_gpus unset"
    ):
        spec.check_resources(2, local=True)


def test_one_failed_stop_call_does_not_cut_the_others_short_and_states_come_from_the_answers(tmp_path, fake_ray):
    hosts = [Host(itertools.repeat(_info(100 + i))) for i in range(3)]
    hosts[1].stop = Method(lambda grace_s, terminate: Ref(exc=ray.exceptions.ActorDiedError()))
    hosts[2].stop = Method(lambda grace_s, terminate: Ref(3))
    pool = _pool(_spec(tmp_path), hosts)
    pool.poll()
    results = stop_hosts(pool.stop_calls(drain=True))
    assert results["gen-0"] == 0 and "its actor failed" in results["gen-1"] and results["gen-2"] == 3
    assert len(fake_ray) == 3, "every actor is removed"
    pool.record(results)
    assert [pool.state.generators[f"gen-{i}"].state for i in range(3)] == ["done", "dead", "dead"]
    assert pool.state.generators["gen-2"].reason == "exited with 3"


def test_a_restarted_learner_resumes_from_this_runs_checkpoint_and_an_older_runs_is_refused(tmp_path):
    group = LearnerGroup.__new__(LearnerGroup)
    group.spec = SimpleNamespace(out=tmp_path)
    assert not group.has_checkpoint()  # a restart before the first checkpoint starts from step 0
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("step00000020")
    assert group.has_checkpoint()
    with pytest.raises(ValueError, match="checkpoints of an earlier run"):  # so a fresh run never finds one
        preflight.prepare(str(ROOT / "configs/ci-tiny.yaml"), [], str(tmp_path), True, local=False)


def test_learner_restarts_need_checkpoints():
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="learner.restarts"):
        load_config(None, ["--learner.restarts=1"])
    load_config(None, ["--learner.restarts=1", "--learner.checkpoint_every_steps=10"])


def test_ray_runs_hand_weights_over_as_folders_or_pushes_never_in_shared_memory():
    from conftest import ROOT

    from asyncrl.config import ConfigError, load_config
    from asyncrl.weights.transports import transport_of

    one_gpu = load_config(ROOT / "configs/arith-smollm2.yaml")
    assert transport_of(one_gpu) == "shared"
    assert driver._without_shared_weights(one_gpu) == ["--learner.shared_weights=false"]
    assert transport_of(one_gpu) == "folder"
    with pytest.raises(ConfigError, match="learner.shared_weights: not with --ray"):
        driver._without_shared_weights(load_config(ROOT / "configs/quickstart.yaml", ["--learner.shared_weights=true"]))


def test_an_entrypoint_child_execs_only_while_its_actor_lives():
    import subprocess
    import sys

    from conftest import ROOT

    child = [sys.executable, "-m", "asyncrl.launch.ray.actors"]
    ran = subprocess.run(
        [*child, str(os.getpid()), "-c", "import os; print(os.getppid())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0 and ran.stdout.strip() == str(os.getpid()), ran.stderr
    orphan = subprocess.run(
        [*child, "1", "-c", "print('ran')"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )  # as if its actor had died before the death signal was armed
    assert orphan.returncode == 1 and "ran" not in orphan.stdout


def test_a_failed_child_takes_what_it_started_down_with_its_actor(tmp_path, monkeypatch):
    """A generator that crashed leaves vLLM's engine core behind in its process group, holding the GPU its
    restarted actor needs: the actor kills the group before it exits."""
    import time

    from asyncrl.launch.ray import actors

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(was_current_actor_reconstructed=False))
    exited = []
    monkeypatch.setattr(actors.os, "_exit", exited.append)  # the actor's end, which Ray restarts
    host = actors.EntrypointHost("generator-0", str(tmp_path / "g.log"), exit_with_child=True)
    pids = tmp_path / "pids"
    crash = (
        "import os, signal, subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); open({str(pids)!r}, 'w')"
        ".write(str(p.pid)); os.kill(os.getpid(), signal.SIGKILL)"
    )
    host.start(["-c", crash], cwd=str(ROOT))
    deadline = time.monotonic() + 60
    while not exited:
        assert time.monotonic() < deadline, "the actor did not see its child die"
        time.sleep(0.05)
    left = int(pids.read_text())
    while (Path(f"/proc/{left}/stat").exists()) and Path(f"/proc/{left}/stat").read_text().split(")")[1].split()[
        0
    ] != "Z":
        assert time.monotonic() < deadline, "the child's own child outlived it"
        time.sleep(0.05)
    assert exited == [1]


def test_generators_kept_on_this_node_by_a_loopback_endpoint_must_fit_on_it(tmp_path, monkeypatch):
    from asyncrl.launch.ray.spec import loopback_endpoint

    head = load_config(None, ["--coordinator.address=tcp://10.0.0.1:5556"])  # the buffer left at 127.0.0.1
    assert loopback_endpoint(head) == "buffer.address tcp://127.0.0.1:5555"
    assert loopback_endpoint(load_config(None, [
        "--coordinator.address=tcp://10.0.0.1:5556", "--buffer.address=tcp://10.0.0.1:5555",
    ])) is None  # fmt: skip
    two_nodes = [
        {"Alive": True, "Resources": {"node:10.0.0.1": 1.0, "GPU": 4.0, "CPU": 32.0}},
        {"Alive": True, "Resources": {"node:10.0.0.2": 1.0, "GPU": 4.0, "CPU": 32.0}},
    ]
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr(ray, "nodes", lambda: two_nodes)
    spec = _spec(tmp_path)
    spec.pin, spec.learner_gpus, spec.generator_gpus = {"node:10.0.0.1": 0.001}, 1, 1
    spec.check_resources(3, local=False)  # 1 + 3 GPUs: the head node holds them
    with pytest.raises(RuntimeError, match=r"every generator runs on this node \(10.0.0.1.*need 7 GPUs where it has 4"):
        spec.check_resources(6, local=False)  # the cluster's 8 would have passed
