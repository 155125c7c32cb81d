"""``asyncrl run`` when its learner dies: the run fails at once and says how the learner ended."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, stop_process

from asyncrl import run_folder
from asyncrl.launch import preflight
from asyncrl.observe.metrics import read_metrics
from asyncrl.run_folder import exit_description

pytestmark = pytest.mark.slow


def _pids_of(module: str, run_dir: Path) -> list[int]:
    """Processes running ``python -m module`` for this run (their command lines carry the run folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if module.encode() in cmdline and any(str(run_dir).encode() in part for part in cmdline):
            pids.append(int(proc.name))
    return pids


def _training(run_dir: Path) -> subprocess.Popen:
    """`asyncrl run` of the quickstart with no end in sight, once it has trained 3 steps."""
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            str(ROOT / "configs/quickstart.yaml"),
            "--run-dir",
            str(run_dir),
            "--free-ports",
            "--timeout-s",
            "120",
            "--learner.total_steps=100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 90  # real time: a real run in other processes, until it has trained a few steps
    while len(read_metrics(run_dir)) < 3:
        if run.poll() is not None or time.monotonic() > deadline:
            stop_process(run)
            pytest.fail("the run never trained")
        time.sleep(0.2)
    return run


def _signal_the_learner(run_dir: Path, sig: int) -> tuple[int, str]:
    """A training run's exit code and output once its learner alone got ``sig``."""
    run = _training(run_dir)
    try:
        (learner,) = _pids_of("learners.cli", run_dir)
        os.kill(learner, sig)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            stop_process(run)
    return run.returncode, output


def test_a_learner_killed_like_the_oom_killer_fails_the_run_with_that_reason(tmp_path):
    returncode, output = _signal_the_learner(tmp_path, signal.SIGKILL)
    assert returncode != 0
    assert "the learner failed (killed by SIGKILL (also how the kernel's out-of-memory killer" in output, output[-2000:]
    assert _pids_of("generators.cli", tmp_path) == [], "the generators were stopped with the run"


def test_exit_descriptions_name_the_signal():
    assert exit_description(3) == "exited with 3"
    assert exit_description(-signal.SIGTERM) == "killed by SIGTERM"
    assert exit_description(-200) == "killed by signal 200"


def test_free_ports_come_from_outside_the_kernels_ephemeral_range_and_are_distinct():
    """A port from bind(0) can be handed to another process's connection before the push group binds it."""
    import socket

    from asyncrl.wire.ports import _ephemeral_ports, free_port

    low, high = _ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(not low <= port <= high for port in ports), (low, high, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free, as promised


def test_a_run_stopped_by_sigterm_stops_the_processes_it_started(tmp_path):
    """`timeout`, `kill` or a scheduler: the learner and generator trained on, orphaned, after the launcher went."""
    run = _training(tmp_path)
    try:
        assert _pids_of("learners.cli", tmp_path) and _pids_of("generators.cli", tmp_path)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    finally:
        stop_process(run)
    assert run.returncode == 130, out[-2000:]
    assert "asyncrl run: stopped (SIGTERM)" in out and "Traceback" not in out
    assert not _pids_of("learners.cli", tmp_path) and not _pids_of("generators.cli", tmp_path)


def test_a_second_run_is_refused_on_a_port_in_use_or_in_a_folder_in_use(tmp_path):
    """A second run on the default ports once joined the first: its generator, under the same id, took the first
    run's work and had the first run's own generator told to stop. A second run in one folder mixed the records."""
    import socket

    from asyncrl.launch.preflight import prepare
    from asyncrl.run_folder import release

    config = str(ROOT / "configs/quickstart.yaml")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        with pytest.raises(
            ValueError,
            match=rf"coordinator.address: tcp://127.0.0.1:{taken} is in use on this "
            r"machine \(another run\?\); --free-ports picks free ones",
        ):
            prepare(config, [f"--coordinator.address=tcp://127.0.0.1:{taken}"], str(tmp_path / "b"), False)
    assert not (tmp_path / "b").exists(), "refused before anything was written"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from asyncrl.run_folder import claim; claim(Path(sys.argv[1])); print('held', flush=True); "
            "time.sleep(60)",
            str(tmp_path / "a"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "a" / "consumed.jsonl").write_text("{}\n")
        (tmp_path / "a" / "push.secret").write_text("the running run's\n")
        with pytest.raises(ValueError, match=rf"run folder .*a is in use by another run \(pid {holder.pid}\)"):
            prepare(config, ["--push.address=127.0.0.1:29500"], str(tmp_path / "a"), True)
        assert (tmp_path / "a" / "consumed.jsonl").exists(), "the running run's records are left alone"
        assert (tmp_path / "a" / "push.secret").read_text() == "the running run's\n", (
            "its generators still join its pushes (a restarted one reads the secret again)"
        )
        (tmp_path / "a" / "push.secret").unlink()
    finally:
        stop_process(holder)
    (tmp_path / "a" / "eval").mkdir()
    (tmp_path / "a" / "eval" / "v000006.jsonl").write_text("{}\n")
    (tmp_path / "a" / "trace.json").write_text("{}")
    prepare(config, [], str(tmp_path / "a"), True)  # free again, and a fresh run clears the earlier one's records
    release(tmp_path / "a")
    assert not [p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".")], (
        "records, evaluation traces and timelines of the earlier run are gone"
    )


def test_an_in_process_buffer_is_refused_for_a_run_of_several_processes(tmp_path):
    from asyncrl.launch.preflight import prepare

    with pytest.raises(ValueError, match="buffer.type: inproc passes rollouts within one process"):
        prepare(str(ROOT / "configs/quickstart.yaml"), ["--buffer.type=inproc"], str(tmp_path / "r"), True)


def test_a_model_folder_that_is_not_there_is_named_before_anything_starts(tmp_path):
    """Following an older README (`models/smollm2` for `models/smollm2-135m`) failed 36 s later in the learner,
    as a download from the Hugging Face Hub that this machine cannot reach."""
    from asyncrl.launch.preflight import check_model_path

    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError,
        match=r"model.path: .*models/smollm2 does not exist \(.*models holds: "
        r"smollm2-135m\)",
    ):
        check_model_path(str(tmp_path / "models" / "smollm2"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_path(str(tmp_path / "models" / "smollm2-135m"))
    check_model_path(str(ROOT / "assets/tiny-llama"))
    with pytest.raises(
        FileNotFoundError,
        match=r"tiny-llama/config.json is a file; give the HF model folder that "
        r"holds it \(.*assets/tiny-llama\)",
    ):
        check_model_path(str(ROOT / "assets/tiny-llama/config.json"))


def test_a_hub_id_is_checked_against_the_cache_and_a_folder_not_written_yet_says_how_to_write_it(tmp_path, monkeypatch):
    """Before `asyncrl model import`, `models/smollm2-135m` reads as a Hub id (no `models/` here): every
    process failed on its own with a download traceback."""
    from huggingface_hub import constants

    from asyncrl.launch.preflight import check_model_path

    cache = tmp_path / "hub"
    snapshot = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs").mkdir()
    (cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # in the cache: transformers loads it from there
    with pytest.raises(
        FileNotFoundError,
        match=r"model.path: models/smollm2-135m is not a folder here, nor a Hugging "
        r"Face Hub model this machine can fetch \(not in the local cache, and "
        r"HF_HUB_OFFLINE is set\); write it with `asyncrl model import "
        r"smollm2-135m models/smollm2-135m`",
    ):
        check_model_path("models/smollm2-135m")


def test_a_run_from_a_project_with_its_own_generators_folder_uses_asyncrls_and_finds_the_projects_reward(tmp_path):
    """`python -m` put the working directory first on every process's path: a user's `generators/` shadowed
    asyncrl's (ImportError in every generator). Their own reward module there must still be found."""
    (tmp_path / "generators").mkdir()
    (tmp_path / "generators" / "__init__.py").write_text("")
    (tmp_path / "my_project_reward.py").write_text(
        "from asyncrl.tasks.digits import digit_reward\n\n\ndef score(response, item):\n"
        "    return digit_reward(response, item)\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            str(ROOT / "configs/quickstart.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "--free-ports",
            "--timeout-s",
            "120",
            "--learner.total_steps=5",
            f"--model.path={ROOT / 'assets/tiny-llama'}",
            "--task.reward=my_project_reward:score",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=180,
        env={key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"},
    )  # as a user's shell
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_the_processes_a_launcher_started_stop_when_it_is_killed(tmp_path):
    # SIGKILL (the out-of-memory killer, a sweep giving up on a run) leaves the launcher no time to stop them.
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(120)\n")
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from asyncrl.launch.local import Launch\n"
        f"launch = Launch('unused.yaml', [], Path({str(tmp_path)!r}))\n"
        "launch.start('sleeper', 'sleeper', [])\n"
        "print(launch.procs['sleeper'].pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    launcher = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert launcher.returncode == -signal.SIGKILL, launcher.stderr
    child = int(launcher.stdout.split()[0])
    deadline = time.monotonic() + 10  # real time: the kernel delivers the death signal and the child exits
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child), "the child outlived its launcher"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_takes_the_cleanup_path_of_ctrl_c_and_a_second_one_the_default():
    from asyncrl.launch.processes import interrupt_on_sigterm

    previous = interrupt_on_sigterm()  # asyncrl run and asyncrl run --ray alike
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never waited out: the handler raises at once, here in the main thread
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (a run under nohup starts with it ignored)
        interrupt_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="SIGHUP"):  # the terminal or SSH session closed
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: a closed session must stop nothing
        interrupt_on_sigterm()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_run_folder_refused_at_start_is_not_held(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("step00000020")
    with pytest.raises(ValueError, match="checkpoints of an earlier run"):
        preflight.prepare(str(ROOT / "configs/ci-tiny.yaml"), [], str(tmp_path), True, local=False)
    assert tmp_path.resolve() not in run_folder._claimed, "a sweep's later run, or another process, may use it"


def test_a_learner_stopped_on_its_own_fails_the_run_and_says_it_can_resume(tmp_path):
    """A SIGTERM to the learner alone (a scheduler, an operator): it checkpoints and exits 0 without a summary."""
    returncode, output = _signal_the_learner(tmp_path, signal.SIGTERM)
    assert returncode != 0
    assert "the learner stopped before its last step" in output and "--resume continues the run" in output, output[
        -2000:
    ]


def test_a_resumed_run_appends_to_the_logs_of_the_run_it_continues(tmp_path):
    """The log of the run that crashed says why: a resume must not wipe it."""
    from asyncrl.launch.processes import Launch

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "learner.log").write_text("why the earlier run ended\n")
    for resume in (True, False):
        launch = Launch("config.yaml", [], tmp_path, resume=resume)
        launch.start("learner", "this", [])  # prints the Zen of Python
        assert launch.procs["learner"].wait(timeout=30) == 0
        text = (tmp_path / "logs" / "learner.log").read_text()
        assert ("why the earlier run ended" in text) is resume and "Beautiful is better than ugly." in text
        if resume:
            assert text.index("why the earlier run ended") < text.index("===== asyncrl run --resume, ")


def test_a_learner_refuses_a_weights_folder_another_learner_publishes_into(tmp_path):
    """learner.weights_dir on /dev/shm, shared by two configs: each would serve the other's versions as its own."""
    shared = tmp_path / "shm-weights"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from asyncrl.run_folder import claim; claim(Path(sys.argv[1]), 'weights'); "
            "print('held', flush=True); time.sleep(60)",
            str(shared),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "learners.cli",
                str(ROOT / "configs/ci-tiny.yaml"),
                f"--run_dir={tmp_path / 'b'}",
                f"--learner.weights_dir={shared}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    finally:
        stop_process(holder)
    assert second.returncode == 2, second.stderr[-2000:]
    assert (
        f"learner.weights_dir: weights folder {shared} is in use by another run (pid {holder.pid})" in second.stderr
        and "give each run its own learner.weights_dir" in second.stderr
    )


def test_a_start_that_fails_stops_what_had_started(monkeypatch):
    """A generator that cannot start (say, Ctrl-C while it is being started) leaves no learner running."""
    from asyncrl.config import load_config
    from asyncrl.launch import local

    events = []

    class Launch:
        def __init__(self, *args, **kwargs):
            self.procs = {}

        def start(self, name, *args, **kwargs):
            if name.startswith("generator"):
                raise KeyboardInterrupt
            events.append(f"start {name}")

        def stop_all(self, **kwargs):
            events.append("stop_all")

    monkeypatch.setattr(local, "Launch", Launch)
    config = load_config(ROOT / "configs/quickstart.yaml", [])
    with pytest.raises(KeyboardInterrupt):
        local._start("configs/quickstart.yaml", [], config, False, None)
    assert events == ["start learner", "stop_all"]


def test_runs_side_by_side_that_finished_are_summarized_when_another_failed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncrl.launch import local

    configs = [SimpleNamespace(name=name, run_dir=str(tmp_path / name)) for name in ("a", "b")]
    monkeypatch.setattr(local, "prepare", lambda path, *rest: (configs["ab".index(path)], []))
    monkeypatch.setattr(local, "release", lambda out: None)
    monkeypatch.setattr("asyncrl.config.check_shared_engine", lambda configs, paths: None)
    launches = [
        SimpleNamespace(procs={"learner": SimpleNamespace(returncode=code)}, tail=lambda side: "oom") for code in (1, 0)
    ]
    monkeypatch.setattr(local, "_start_shared", lambda *args: (launches, None))
    monkeypatch.setattr(local, "_supervise_shared", lambda *args: None)
    monkeypatch.setattr(local.mps, "daemon_for", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(local, "stopped_early", lambda out: None)
    summarized = []
    monkeypatch.setattr(local, "summarize", lambda config, out, *rest: summarized.append(config.name) or {})
    with pytest.raises(RuntimeError, match="the learner of a failed"):
        local.run_shared(["a", "b"], [], free_ports=False, timeout_s=60, quiet=True)
    assert summarized == ["b"]  # b finished: its summary is written, so a sweep keeps it
