"""A deployment across hosts on one machine: network namespaces joined by a bridge (``scripts/hosts.py``), as root.

The learner runs on h1 and binds its buffer, coordinator and weight server on
h1's address; generators run on h2 and h3, each in its own folder, with the
learner's folder hidden from them, so weights reach them over the network
only. Every socket holds the run's CURVE secret, copied onto each host. In
one run, in turn: h2 is cut off for ``CUT_S`` while a new host, h4, joins by
hand; h2 comes back and trains again; h3 is killed outright (every process
on it). The run learns, and every rollout is counted as the chaos tests
count: trained once, dropped with a reason, released to be generated again,
or in flight when the run ended; no prompt is trained twice. In another, the
learner's host loses power past a checkpoint and the learner is started
again on it with ``--resume``; the generators wait for it and go on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ROOT, accounted

from asyncrl.launch.viewer.tail import Tail
from asyncrl.observe.metrics import read_metrics


def _load_hosts_module():
    spec = importlib.util.spec_from_file_location("hosts", ROOT / "scripts" / "hosts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hosts"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


hosts_module = _load_hosts_module()
Hosts, HostsError = hosts_module.Hosts, hosts_module.HostsError

# The runs here end by their time budget (TRAIN_S), which assumes they have the machine to themselves.
pytestmark = pytest.mark.alone
CONFIG = str(ROOT / "configs/quickstart.yaml")
# The cut outlasts the generator's lease (2.7 leases) and four coordinator timeouts, so it meets every event a
# 30 s cut meets under a lease of 10 s: the learner takes the tickets back, the generator's requests time out and
# reconnect, and what it wrote arrives late. Under the default 60 s lease, a 30 s cut would not even reach that.
# ASYNCRL_HOSTS_CUT_S=30 plays the 30 s cut itself (the run is that much longer).
LEASE_S, COORDINATOR_TIMEOUT_S, CUT_S = 3.0, 2.0, float(os.environ.get("ASYNCRL_HOSTS_CUT_S", "8"))
TRAIN_S = round(30 + max(0.0, CUT_S - 8))  # learner.max_train_s: the run ends by time, as its faults take time
BOUND = 1  # the quickstart's max_staleness
IN_FLIGHT = (BOUND + 1) * 16 * 8  # samples the staleness bound lets out at once (two versions of 16 groups of 8)
SECRET = "secrets/run.key_secret"
ENV = {"PYTHONUNBUFFERED": "1"}
# The restarted learner: a checkpoint every CHECKPOINT_EVERY steps, killed at least KILL_PAST steps past one, so that
# steps are undone; the run ends at STEPS, well after the restart. Generators wait up to PATIENCE_S for it.
CHECKPOINT_EVERY, KILL_PAST, STEPS, PATIENCE_S = 5, 2, 40, 60.0


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator:
    """A :class:`Hosts` on a bridge of its own, all of it removed after the test, pass or fail."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (scripts/hosts.py)")
    made = Hosts(tmp_path / "hosts")
    try:
        made.add()
    except HostsError as exc:
        made.close()
        pytest.skip(f"cannot make a network namespace here: {exc}")
    with made:
        yield made


def _wait(what: str, condition: Callable[[], bool], timeout_s: float, alive: Callable[[], None]) -> None:
    """Poll ``condition`` until it holds, failing after ``timeout_s`` or as soon as ``alive()`` fails."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        alive()
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g}s"
        time.sleep(0.1)  # real time: other processes, on other hosts, at work


class Consumed:
    """``consumed.jsonl`` read as it grows, as the run viewer reads it: the rollouts trained on so far (a file
    a resumed learner cut back is read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path, self._tail = path, Tail()

    def read(self) -> list[dict]:
        return self._tail.read(self.path)[0]

    def by(self, generator: str, after_step: int = 0) -> bool:
        return any(r["generator"] == generator and r["step"] > after_step for r in self.read())


def _produced(host) -> list[str]:
    path = host.folder / "produced.txt"
    return path.read_text().split() if path.exists() else []


class Deployment:
    """One run of this file's: the learner on h1, generators started on other hosts by hand.

    Every process gets the run's addresses on h1, its CURVE secret (made on
    h1 and copied to each generator's host, as scp would), one torch thread
    and ``extra`` settings; each one's output goes to ``logs/HOST.log``.
    """

    def __init__(self, hosts, logs: Path, extra: list[str]) -> None:
        self.hosts, self.logs = hosts, logs
        a = hosts["h1"]
        self.run_dir = a.folder / "run"
        self.settings = [
            f"--model.path={ROOT / 'assets/tiny-llama'}",
            f"--buffer.address=tcp://{a.address}:5555",
            f"--coordinator.address=tcp://{a.address}:5556",
            f"--coordinator.weights_address=tcp://{a.address}:5557",
            "--coordinator.weight_deltas=true",
            f"--buffer.curve_secret_file={SECRET}",
            f"--coordinator.curve_secret_file={SECRET}",
            f"--coordinator.generator_lease_s={LEASE_S}",
            f"--coordinator.timeout_s={COORDINATOR_TIMEOUT_S}",
            "--task.prompt_args.num_prompts=50000",  # one epoch: a prompt trained twice would be a group trained twice
            "--learner.torch_threads=1",
            "--generator.torch_threads=1",
            *extra,
        ]
        keys = a.run(["asyncrl", "keys", "secrets/run"])
        assert keys.returncode == 0, keys.stderr
        self.learner: subprocess.Popen | None = None
        self.generators: dict[str, subprocess.Popen] = {}
        self.consumed = Consumed(self.run_dir / "consumed.jsonl")

    def start_learner(self, resume: bool = False) -> None:
        args = ["asyncrl-learner", CONFIG, "--run-dir", "run", *self.settings, *(["--resume"] if resume else [])]
        self.learner = self.hosts["h1"].popen(args, self.logs / "h1.log", ENV)

    def start_generator(self, host) -> None:
        self.hosts.copy("h1", "secrets", [host.name])  # as scp would
        args = ["asyncrl-generator", CONFIG, "--generator-id", host.name, "--produced-log", "produced.txt"]
        self.generators[host.name] = host.popen([*args, *self.settings], self.logs / f"{host.name}.log", ENV)

    def alive(self) -> None:
        """Fail, with its log's end, if any process of the run has exited."""
        self.generators_alive()
        assert self.learner.poll() is None, f"h1 exited ({self.learner.returncode}): " + self.log("h1")[-3000:]

    def generators_alive(self) -> None:
        """Fail, with its log's end, if a generator has exited."""
        for name, proc in self.generators.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}): " + self.log(name)[-3000:]

    def steps(self) -> int:
        return len(read_metrics(self.run_dir))

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def finish(self, timeout_s: float) -> None:
        """Wait for the learner to end the run, then for every generator it told to stop; each exits 0."""
        assert self.learner.wait(timeout=timeout_s) == 0, self.log("h1")[-3000:]
        for name, proc in self.generators.items():
            assert proc.wait(timeout=60) == 0, self.log(name)[-3000:]

    def stop(self) -> None:
        """SIGKILL, by its PID, every process of the run still running (a test that failed midway)."""
        for proc in [self.learner, *self.generators.values()]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def trained_once(self) -> list[dict]:
        """The run's accounting (:func:`conftest.accounted`) and its bounds: within the staleness bound, no prompt
        trained twice; the rollouts trained on."""
        trained = accounted(self.run_dir)
        assert max(r["staleness"] for r in trained) <= BOUND
        groups_of = Counter(r["prompt"] for r in {r["id"].rsplit("-", 1)[0]: r for r in trained}.values())
        assert max(groups_of.values()) == 1, "no prompt is trained twice (one epoch of prompts)"
        return trained

    def dropped(self) -> set[str]:
        return {json.loads(line)["id"] for line in (self.run_dir / "dropped.jsonl").read_text().splitlines()}


def test_hosts_reach_each_other_and_share_no_folder(hosts):
    a = hosts["h1"]
    b = hosts.add()
    (a.folder / "secret.txt").write_text("h1 only")
    connect = f"import socket; s = socket.socket(); s.settimeout(1); print(s.connect_ex(('{a.address}', 9)))"
    refused = b.run([sys.executable, "-c", connect])
    assert refused.stdout.strip() == "111", "h1 answers h2 (connection refused: nothing listens on port 9)"
    seen = b.run(["sh", "-c", f"ls {hosts.root}; ls; echo $TMPDIR; ls /dev/shm | wc -l"])
    assert seen.stdout.split() == ["h2", "tmp", str(b.folder / "tmp"), "0"], seen
    assert (a.folder / "secret.txt").exists(), "hidden on h2, not removed"
    b.cut()
    assert b.run([sys.executable, "-c", connect]).stdout.strip() == "11", "cut off: no answer at all"
    b.mend()
    assert b.run([sys.executable, "-c", connect]).stdout.strip() == "111"
    b.popen(["sleep", "600"])
    b.kill()
    assert not b.pids()
    hosts.close()
    namespaces, links = hosts_module._existing()
    assert not [name for name in namespaces + links if name.startswith(hosts.instance)]


@pytest.mark.parametrize("killed", ["mid-request", "before"])
def test_a_weight_fetch_from_a_killed_learner_fails_at_once(tmp_path, killed):
    """A learner killed while a generator's fetch waits for it never answers that request, even once restarted;
    one killed just before the fetch (right after it announced the version) has nothing listening. Either way
    the fetch fails at once, not after ``generator.weight_load_timeout_s``, and the generator goes back to the
    coordinator, which it waits for with patience (seen with both generators of the restart test below)."""
    import threading

    import zmq
    from conftest import free_port

    from asyncrl.weights.served import fetch

    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)  # the weight server, as far as taking the request
    if killed == "mid-request":
        server.bind(address)
    outcome: dict[str, object] = {}

    def client() -> None:
        started = time.monotonic()
        try:
            fetch(1, address, tmp_path / "cache", timeout_s=60.0)
        except TimeoutError as exc:
            outcome["error"] = str(exc)
        outcome["took_s"] = time.monotonic() - started

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        if killed == "mid-request":
            assert server.poll(10_000), "the fetch's request did not arrive within 10 s"
            server.recv_multipart()
    finally:
        server.close(linger=0)  # its connections drop, as a killed process's do
        context.term()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the fetch still waits for an answer that cannot come"
    says = "dropped before it answered" if killed == "mid-request" else "nothing accepts connections"
    assert says in outcome["error"] and outcome["took_s"] < 5, outcome


@pytest.mark.slow
@pytest.mark.realtime  # the cut lasts CUT_S of real time: the processes cut off are on their own clocks
def test_a_run_across_hosts_survives_a_cut_a_kill_and_a_new_host(hosts, tmp_path):
    started = time.monotonic()
    a, b, c = hosts["h1"], hosts.add(), hosts.add()
    # Ends by time, as its faults take time, not steps.
    run = Deployment(hosts, tmp_path, ["--learner.total_steps=100000", f"--learner.max_train_s={TRAIN_S}"])
    consumed = run.consumed
    timeline = {}
    try:
        run.start_learner()
        run.start_generator(b)
        run.start_generator(c)
        assert b.run(["test", "-e", str(a.folder / "secrets")]).returncode == 1, "h1's folder is hidden on h2"
        _wait("steps of h2's and h3's", lambda: consumed.by("h2") and consumed.by("h3"), 150, run.alive)
        timeline["both trained"] = time.monotonic() - started

        # h2 cut off for longer than its lease, while h4 joins by hand.
        cut_step, written_before_cut = run.steps(), len(_produced(b))
        b.cut()
        run.start_generator(d := hosts.add())
        time.sleep(CUT_S)  # real time: the outage itself
        mend_step, written_in_cut = run.steps(), _produced(b)[written_before_cut:]
        b.mend()
        timeline["mended"] = time.monotonic() - started
        assert mend_step >= cut_step + 3, f"the learner went on without h2: steps {cut_step} -> {mend_step}"
        assert "generator h2 silent" in run.log("h1"), "h2's tickets were taken back when its lease ran out"
        _wait("h2 training again", lambda: consumed.by("h2", after_step=mend_step + 1), 60, run.alive)
        timeline["h2 back"] = time.monotonic() - started

        # h3 killed outright: every process on it, as a machine losing power.
        c.kill()
        run.generators.pop("h3").wait(timeout=10)
        kill_step = run.steps()
        _wait("h3's lease running out", lambda: "generator h3 silent" in run.log("h1"), 30, run.alive)
        _wait("steps after h3 died", lambda: run.steps() >= kill_step + 3, 60, run.alive)
        _wait("h4 training", lambda: consumed.by("h4"), 90, run.alive)
        timeline["h3 gone, h4 in"] = time.monotonic() - started

        run.finish(timeout_s=TRAIN_S + 60)
        timeline["done"] = time.monotonic() - started
    finally:
        print("timeline (s):", {k: round(v, 1) for k, v in timeline.items()})
        run.stop()

    run_dir = run.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir)
    assert f"learner.max_train_s ({TRAIN_S} s) spent" in run.log("h1"), "the run ended by time, after every fault"
    assert records[-1]["step"] == summary["steps"] == len(records) > kill_step
    start, end = (sum(r["reward"] for r in part) / len(part) for part in (records[:10], records[-10:]))
    assert end > start + 0.1, f"reward did not rise: {start:.3f} -> {end:.3f}"

    trained = run.trained_once()
    assert {r["generator"] for r in trained} == {"h2", "h3", "h4"}
    seen = {r["id"] for r in trained} | run.dropped()
    # What h2 wrote while cut off (if its cut came mid-batch) waited in its connection, and reached the learner once
    # the link was back: trained, or dropped as orphaned where its tickets had gone to others.
    assert set(written_in_cut) <= seen
    for host in (b, d):  # generators that lived to the end: what they wrote and the learner did not see
        unseen = set(_produced(host)) - seen  # was in flight when the run ended
        assert len(unseen) <= IN_FLIGHT, (host.name, len(unseen))
    # What h3 wrote and never sent died with it; the learner took its tickets back and issued their prompts again.
    lost = set(_produced(c)) - seen
    assert len(lost) <= summary["slots_released"].get("generator_lost", 0), (len(lost), summary["slots_released"])
    assert "delta v" in run.log("h1"), "the learner made deltas for the generators to fetch"
    for name in ("h2", "h4"):
        assert "loaded weights v" in run.log(name)


@pytest.mark.slow
@pytest.mark.realtime  # the learner's host is down for real time, on the generators' own clocks
def test_generators_wait_for_the_learners_host_to_restart_and_the_run_resumes(hosts, tmp_path):
    """h1 loses power past a checkpoint; its learner is started again there with ``--resume``, on the same
    addresses and keys. The generators on h2 and h3 are not restarted: they wait for it (up to
    ``generator.learner_patience_s``), take its weights and go on; the steps the crash undid are trained again,
    and nothing is trained twice."""
    started = time.monotonic()
    a, b, c = hosts["h1"], hosts.add(), hosts.add()
    extra = [
        f"--learner.total_steps={STEPS}",
        f"--learner.checkpoint_every_steps={CHECKPOINT_EVERY}",
        f"--generator.learner_patience_s={PATIENCE_S}",
    ]
    run = Deployment(hosts, tmp_path, extra)
    latest = run.run_dir / "checkpoints" / "LATEST"

    def checkpointed_step() -> int:
        return int(latest.read_text().strip().removeprefix("step")) if latest.exists() else 0  # written atomically

    timeline = {}
    try:
        run.start_learner()
        run.start_generator(b)
        run.start_generator(c)
        _wait(
            "a checkpoint and steps past it",
            lambda: checkpointed_step() and run.steps() >= checkpointed_step() + KILL_PAST,
            150,
            run.alive,
        )
        a.kill()  # every process on h1, as a machine losing power
        assert run.learner.wait(timeout=10) != 0
        timeline["h1 killed"] = time.monotonic() - started
        killed_at, resumed_at = run.steps(), checkpointed_step()
        undone = [r for r in run.consumed.read() if r["step"] > resumed_at]  # consumed.jsonl, before the resume
        assert killed_at < STEPS and undone, (killed_at, resumed_at)
        waited = {name: len(run.log(name)) for name in ("h2", "h3")}
        _wait(
            "the generators waiting for the learner",
            lambda: all("waiting for the learner" in run.log(name)[waited[name] :] for name in waited),
            30,
            run.generators_alive,
        )
        timeline["generators waiting"] = time.monotonic() - started

        h1_mark, marks = len(run.log("h1")), {name: len(run.log(name)) for name in ("h2", "h3")}
        run.start_learner(resume=True)  # the same folder, addresses and secret
        _wait(
            "both generators training for the resumed learner",  # past any step the killed learner wrote down
            lambda: all(run.consumed.by(name, after_step=killed_at + 1) for name in ("h2", "h3")),
            90,
            run.alive,
        )
        timeline["both back"] = time.monotonic() - started
        run.finish(timeout_s=120)
        timeline["done"] = time.monotonic() - started
    finally:
        print("timeline (s):", {k: round(v, 1) for k, v in timeline.items()})
        run.stop()

    resumed_log = run.log("h1")[h1_mark:]
    assert f": step {resumed_at}, version " in resumed_log and "resumed from" in resumed_log, resumed_log[-3000:]
    for name in ("h2", "h3"):
        assert "loaded weights v" in run.log(name)[marks[name] :], f"{name} took the resumed learner's weights"
    records = read_metrics(run.run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "the undone steps are done again, once each"
    trained = run.trained_once()
    # The steps the crash undid: their groups were out at the checkpoint (reissued, under the same ids) or issued
    # after it (issued again from the checkpoint's cursor); trained again in the resumed run, unless dropped with a
    # reason there (a group from before the crash arriving with versions the resumed learner never made, say).
    summary = json.loads((run.run_dir / "summary.json").read_text())
    print("summary:", {k: summary[k] for k in ("steps", "samples_consumed", "samples_dropped", "slots_released")})
    assert set(summary["samples_dropped"]) <= {"stale", "orphaned", "duplicate", "future_version"}
    never_again = {r["prompt"] for r in undone} - {r["prompt"] for r in trained}
    assert len(never_again) <= sum(summary["samples_dropped"].values()), f"{len(never_again)} undone prompts lost"


@pytest.mark.slow
def test_a_run_across_hosts_through_redis_with_a_password(hosts, tmp_path):
    """The buffer as Redis on the learner's host, bound to its address with a password (the generators get the
    password file as they get the CURVE key); a generator with the wrong password fails at once, naming the key."""
    a, b = hosts["h1"], hosts.add()
    port = 6390
    run = Deployment(hosts, tmp_path, ["--learner.total_steps=60", "--learner.checkpoint_every_steps=20"])
    (a.folder / "secrets" / "redis.pass").write_text("s3cret-for-this-run\n")
    (a.folder / "redis.conf").write_text(
        f'bind {a.address}\nport {port}\nrequirepass s3cret-for-this-run\nsave ""\nappendonly no\ndir .\n'
    )
    redis = a.popen(["redis-server", "redis.conf"], tmp_path / "redis.log")
    url = f"redis://{a.address}:{port}/0"
    run.settings += [
        "--buffer.type=redis",
        f"--buffer.redis_url={url}",
        "--buffer.redis_password_file=secrets/redis.pass",
    ]
    try:
        run.start_learner()
        run.start_generator(b)
        (b.folder / "wrong.pass").write_text("not-the-password\n")
        wrong = b.run(
            [
                "asyncrl-generator",
                CONFIG,
                "--generator-id",
                "wrong",
                *run.settings,
                "--buffer.redis_password_file=wrong.pass",
            ],
            timeout_s=120,
        )
        assert wrong.returncode != 0
        said = (wrong.stdout + wrong.stderr).strip().splitlines()[-1]
        assert "buffer.redis_password_file" in said and a.address in said, said
        run.finish(timeout_s=240)
    finally:
        run.stop()
        redis.kill()
        redis.wait(timeout=10)
    trained = run.trained_once()
    assert len(trained) == 60 * 128 and {r["generator"] for r in trained} == {"h2"}
    records = read_metrics(run.run_dir)
    start, end = (sum(r["reward"] for r in part) / len(part) for part in (records[:10], records[-10:]))
    assert end > start + 0.1, f"reward did not rise: {start:.3f} -> {end:.3f}"
