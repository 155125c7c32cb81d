"""CUDA MPS for a run on one GPU (``mps.*``): the run's own daemon, its clients, and the checks before start.

The end-to-end test stands a small program in for ``nvidia-cuda-mps-control``
(this machine has no GPU): it answers the control commands the way the real
one does, and reports as clients the processes whose environment points at its
socket folder, which is what makes a real CUDA process connect. What MPS does
to GPU throughput is measured by bench/e2e.py on a GPU (bench/README.md).
"""

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FakeClock, asyncrl_run

from asyncrl.config import ConfigError, MpsConfig, load_config
from asyncrl.config.shared_engine import check_one_engine
from asyncrl.launch import mps

ROOT = Path(__file__).resolve().parents[1]

FAKE_CONTROL = """#!{python}
# A stand-in for nvidia-cuda-mps-control. `-f`: "the daemon", in the foreground until told to quit (its
# sockets: a file in CUDA_MPS_PIPE_DIRECTORY). On stdin: get_server_list, get_client_list PID, quit; its
# clients: every process whose environment names its pipe folder.
import json, os, sys, time
from pathlib import Path

pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
journal = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"

def log(line):
    with journal.open("a") as f:
        f.write(line + "\\n")

if sys.argv[1:] == ["-f"]:
    (pipe / "control").write_text(str(os.getpid()))
    log("started " + str(pipe) + " CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    while (pipe / "control").exists():
        time.sleep(0.02)
    log("exited")
    sys.exit(0)
if not (pipe / "control").exists():
    print("Cannot find MPS control daemon process"); sys.exit(1)
command = sys.stdin.read().split()
log(" ".join(command))
if command == ["get_server_list"]:
    print(4242)
elif command[:1] == ["get_client_list"]:
    clients = {{}}
    for entry in Path("/proc").iterdir():
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\\0") if "=" in v)
        except (OSError, ValueError):
            continue
        others = entry.name.isdigit() and entry.name not in (str(os.getpid()), (pipe / "control").read_text())
        if env.get("CUDA_MPS_PIPE_DIRECTORY") == str(pipe) and others:
            clients[entry.name] = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            print(entry.name)
    with (journal.parent / "clients.jsonl").open("a") as f:
        f.write(json.dumps(clients) + "\\n")
elif command == ["quit"]:
    (pipe / "control").unlink()
"""


@pytest.fixture
def control(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir()
    path.write_text(FAKE_CONTROL.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


class Recorder:
    """An ``execute`` for :class:`mps.Daemon` that records each command and answers from a script."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.answers = answers

    def __call__(self, argv, stdin, env, timeout_s):
        command = stdin.strip()
        self.calls.append((command, env))
        answer = self.answers.get(command, (0, ""))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @property
    def commands(self) -> list[str]:
        return [command for command, _ in self.calls]


class Foreground:
    """A ``spawn`` for :class:`mps.Daemon`: the daemon as a process that runs until ``quit`` (or exits at once
    with ``exit_code``), and what it was started with."""

    def __init__(self, recorder: Recorder, exit_code: int | None = None) -> None:
        self.recorder, self.exit_code, self.started, self.killed = recorder, exit_code, None, False
        self.pid = 4321

    def __call__(self, argv, env, log):
        self.started = (argv, env, log)
        return self

    def poll(self):
        if self.exit_code is None and "quit" in self.recorder.commands:
            self.exit_code = 0 if self.recorder.answers.get("quit", (0, ""))[0] == 0 else None
        return self.exit_code

    def wait(self, timeout=None):
        if self.poll() is None:
            raise subprocess.TimeoutExpired("mps-control", timeout)
        return self.poll()

    def kill(self):
        self.killed, self.exit_code = True, -9


def _daemon(tmp_path, answers, config=None, exit_code=None):
    execute, clock = Recorder(answers), FakeClock()
    spawn = Foreground(execute, exit_code)
    config = config or MpsConfig(enabled=True, control="mps-control")
    daemon = mps.Daemon(config, tmp_path / "logs" / "mps", execute, spawn, clock=clock, sleep=clock.sleep)
    return daemon, execute, spawn, clock


def test_the_daemon_gets_its_own_pipe_and_its_clients_their_share_of_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the launcher's view, which the daemon must not narrow
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")
    answers = {"get_server_list": (0, "11\n"), "get_client_list 11": (0, "101\n102\n")}
    config = MpsConfig(enabled=True, control="mps-control", generator_thread_percentage=60)
    daemon, execute, spawn, clock = _daemon(tmp_path, answers, config)
    daemon.start()
    pipe = daemon.pipe
    assert pipe.is_dir() and len(str(pipe)) <= 60  # Unix socket paths must stay short
    argv, env, log = spawn.started
    assert argv == ["mps-control", "-f"] and log == tmp_path / "logs" / "mps" / "daemon.log"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and env["CUDA_MPS_LOG_DIRECTORY"].endswith("logs/mps")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert execute.commands == ["get_server_list"]  # started once it answered
    assert daemon.env("generator") == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}
    # None: unset in the learner, whatever share the launcher's own environment has
    assert daemon.env("learner") == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None}

    daemon.observe()
    assert execute.commands[1:] == ["get_server_list", "get_client_list 11"]
    clock.advance(4.9)
    daemon.observe()  # within poll_s: not asked again
    assert len(execute.calls) == 3
    answers["get_client_list 11"] = (0, "102\n103\n")
    clock.advance(0.2)
    daemon.observe()
    assert daemon.summary()["clients_seen"] == 3  # every process seen, not only the last answer's

    daemon.stop()
    assert execute.commands[-1] == "quit" and not spawn.killed
    assert not pipe.exists() and daemon.pipe is None
    daemon.stop()  # once is enough: a second stop asks nothing
    assert execute.commands.count("quit") == 1


def test_a_daemon_that_exits_as_it_starts_says_where_its_log_is_and_leaves_nothing(tmp_path):
    daemon, execute, spawn, _ = _daemon(tmp_path, {}, exit_code=1)
    with pytest.raises(RuntimeError, match=r"exited as it started \(mps-control -f, exit 1\); its log: .*daemon.log"):
        daemon.start()
    assert not Path(spawn.started[1]["CUDA_MPS_PIPE_DIRECTORY"]).exists() and daemon.pipe is None


def test_a_daemon_that_never_answers_is_killed_after_mps_timeout_s(tmp_path):
    silent = {"get_server_list": (1, "Cannot find MPS control daemon process"), "quit": (1, "no daemon")}
    daemon, execute, spawn, clock = _daemon(tmp_path, silent, MpsConfig(enabled=True, control="c", timeout_s=2.0))
    with pytest.raises(RuntimeError, match=r"did not answer 'get_server_list'.*within 2s \(mps.timeout_s\)"):
        daemon.start()
    assert clock.now - 1000.0 >= 2.0 and execute.commands.count("get_server_list") >= 20  # asked every 0.1 s
    assert spawn.killed and daemon.pipe is None


def test_a_daemon_that_stops_answering_leaves_the_count_of_what_was_seen(tmp_path):
    answers = {"get_server_list": (0, "11"), "get_client_list 11": (0, "101")}
    daemon, execute, _, clock = _daemon(tmp_path, answers)
    daemon.start()
    daemon.observe()
    answers["get_server_list"] = subprocess.TimeoutExpired("mps-control", 5)
    clock.advance(10)
    daemon.observe()
    assert daemon.summary()["clients_seen"] == 1
    daemon.stop()


def _config(*overrides: str):
    return load_config(ROOT / "configs/quickstart.yaml", list(overrides))


def test_auto_turns_mps_on_only_where_the_learner_and_a_generator_share_a_gpu(control):
    auto = ["--mps.enabled=auto", f"--mps.control={control}"]
    shared = _config("--learner.devices=0", "--generator.devices=1,0", *auto)
    assert mps.wanted(shared) == (True, "mps.enabled: auto, and the learner and a generator share a GPU")
    apart = _config("--learner.devices=0", "--generator.devices=1", *auto)
    assert mps.wanted(apart) == (False, "mps.enabled: auto, and no generator shares a GPU with the learner")
    assert mps.wanted(_config(*auto))[0]  # neither names a GPU: both take the first they see
    assert not mps.wanted(_config("--learner.devices=1", *auto))[0]  # the generator takes GPU 0
    missing = mps.wanted(_config("--mps.enabled=auto", "--mps.control=/nowhere/mps-control"))
    assert missing == (
        False,
        "mps.enabled: auto, and /nowhere/mps-control is not installed: the processes take turns on the GPU",
    )
    assert mps.wanted(_config()) == (False, "mps.enabled: false")
    assert mps.wanted(_config("--mps.enabled=true")) == (True, "mps.enabled: true")


def test_under_auto_a_daemon_that_cannot_start_leaves_the_run_without_mps_and_says_why(tmp_path):
    """A container without the permission: the control program is there, and its daemon exits as it starts.
    ``auto`` runs on without MPS; ``true`` fails the run."""
    refuses = tmp_path / "bin" / "nvidia-cuda-mps-control"
    refuses.parent.mkdir()
    refuses.write_text("#!/bin/sh\necho 'cannot create the pipe directory: permission denied' >&2\nexit 1\n")
    refuses.chmod(refuses.stat().st_mode | stat.S_IEXEC)
    said: list[str] = []
    config = _config("--mps.enabled=auto", f"--mps.control={refuses}")
    with mps.daemon_for(config, tmp_path / "run", say=said.append) as daemon:
        assert daemon is None
    assert said[0] == "asyncrl run: CUDA MPS on (mps.enabled: auto, and the learner and a generator share a GPU)"
    assert said[1].startswith("asyncrl run: CUDA MPS off after all: the MPS control daemon exited as it started")
    assert said[1].endswith("the processes take turns on the GPU")
    with pytest.raises(RuntimeError, match="exited as it started"):
        with mps.daemon_for(_config("--mps.enabled=true", f"--mps.control={refuses}"), tmp_path / "run2"):
            pass


def test_bad_mps_settings_fail_before_any_process_starts_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"mps.enabled: true needs CUDA MPS's control program, and '/nowhere/x'"):
        mps.check(_config("--mps.enabled=true", "--mps.control=/nowhere/x").mps)
    with pytest.raises(ValueError, match="mps.enabled: true is for asyncrl run on one machine"):
        mps.check(_config("--mps.enabled=true").mps, local=False)
    mps.check(_config("--mps.enabled=auto", "--mps.control=/nowhere/x").mps, local=False)  # auto: off under Ray
    with pytest.raises(ConfigError, match="mps differs from a.yaml's: runs that share a generator share its engine"):
        lora = ["--learner.lora.rank=4", "--generator.backend=vllm"]
        check_one_engine([_config(*lora), _config(*lora, "--mps.enabled=true")], ["a.yaml", "b.yaml"])
    with pytest.raises(ValueError, match=r"mps.generator_thread_percentage must be in \[1, 100\], got 120"):
        _config("--mps.generator_thread_percentage=120")
    # as a user meets it: one line, and no run folder taken
    out = asyncrl_run("configs/quickstart.yaml", tmp_path / "run", "--mps.enabled=true", "--mps.control=/nowhere/x")
    assert out.returncode != 0
    assert "mps.enabled: true needs CUDA MPS's control program" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
def test_a_run_under_mps_points_every_process_at_its_own_daemon_and_stops_it(tmp_path, control):
    run = tmp_path / "run"
    out = asyncrl_run(
        "configs/quickstart.yaml",
        run,
        "--learner.total_steps=40",
        "--mps.enabled=true",
        f"--mps.control={control}",
        "--mps.generator_thread_percentage=60",
        "--mps.learner_thread_percentage=90",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40
    logs = run / "logs" / "mps"
    journal = (logs / "control.log").read_text().splitlines()
    started, pipe, devices = journal[0].split()
    assert started == "started" and devices == "CUDA_VISIBLE_DEVICES=unset"
    assert journal[-2:] == ["quit", "exited"]  # the daemon was asked to quit, and did
    assert "get_server_list" in journal and "get_client_list 4242" in journal
    assert not Path(pipe).exists()  # its socket folder removed
    seen: dict[str, str | None] = {}
    for line in (logs / "clients.jsonl").read_text().splitlines():
        seen |= json.loads(line)
    # the learner and the quickstart's generator (and any process of theirs), each with its side's share
    assert set(seen.values()) == {"60", "90"}, seen
    assert summary["mps"]["clients_seen"] == len(seen) >= 2
    assert f"CUDA MPS clients seen {len(seen)}; " in out.stdout  # the run's last line says MPS took
