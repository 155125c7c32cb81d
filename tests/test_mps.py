"""CUDA MPS for a run on one GPU (``mps.*``): the run's own daemon, its clients, and the checks before start.

The end-to-end test stands a small program in for ``nvidia-cuda-mps-control``
(this machine has no GPU): it answers the control commands the way the real
one does, and reports as clients the processes whose environment points at its
socket folder, which is what makes a real CUDA process connect. What MPS does
to GPU throughput is measured by bench/e2e.py on a GPU (bench/README.md).
"""

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import FakeClock, asyncrl_run

from asyncrl.config import MpsConfig, load_config
from asyncrl.launch import mps

ROOT = Path(__file__).resolve().parents[1]

FAKE_CONTROL = """#!{python}
# A stand-in for nvidia-cuda-mps-control: `-d` starts "the daemon" (writes its state); on stdin,
# get_server_list, get_client_list PID and quit. Its clients: every process whose environment names its pipe.
import json, os, sys
from pathlib import Path

pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
journal = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
journal.parent.mkdir(parents=True, exist_ok=True)

def log(line):
    with journal.open("a") as f:
        f.write(line + "\\n")

if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("An instance of this daemon is already running"); sys.exit(1)
    (pipe / "control").write_text("up")
    log("started")
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
        if env.get("CUDA_MPS_PIPE_DIRECTORY") == str(pipe) and entry.name.isdigit() and int(entry.name) != os.getpid():
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
    """An ``execute`` for :class:`mps.Daemon` that records each call and answers from a script."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.calls: list[tuple[list[str], str | None, dict[str, str]]] = []
        self.answers = answers

    def __call__(self, argv, stdin, env, timeout_s):
        self.calls.append((argv, stdin, env))
        key = " ".join(argv[1:]) or (stdin or "").strip()
        return self.answers.get(key, (0, ""))


def test_the_daemon_gets_its_own_pipe_and_its_clients_their_share_of_the_gpu(tmp_path):
    config = MpsConfig(enabled=True, control="mps-control", generator_thread_percentage=60)
    answers = {"get_server_list": (0, "11\n"), "get_client_list 11": (0, "101\n102\n")}
    execute, clock = Recorder(answers), FakeClock()
    daemon = mps.Daemon(config, tmp_path / "logs" / "mps", execute, clock=clock, poll_s=5.0)
    daemon.start()
    pipe = daemon.pipe
    assert pipe.is_dir() and len(str(pipe)) < 80  # Unix socket paths must stay short
    argv, _, env = execute.calls[0]
    assert argv == ["mps-control", "-d"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and env["CUDA_MPS_LOG_DIRECTORY"].endswith("logs/mps")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # the daemon's own share stays whole
    assert daemon.env("generator")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in daemon.env("learner")
    assert daemon.env("learner")["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)

    daemon.observe()
    asked = len(execute.calls)
    assert [c[1] for c in execute.calls[1:]] == ["get_server_list\n", "get_client_list 11\n"]
    clock.advance(4.9)
    daemon.observe()  # within poll_s: not asked again
    assert len(execute.calls) == asked
    answers["get_client_list 11"] = (0, "102\n103\n")
    clock.advance(0.2)
    daemon.observe()
    assert daemon.summary()["clients_seen"] == 3  # every process seen, not only the last answer's

    daemon.stop()
    assert execute.calls[-1][1] == "quit\n"
    assert not pipe.exists() and daemon.pipe is None
    daemon.stop()  # once is enough: a second stop asks nothing
    assert execute.calls[-1][1] == "quit\n" and len(execute.calls) == asked + 3


def test_a_daemon_that_does_not_start_says_why_and_leaves_nothing(tmp_path):
    execute = Recorder({"-d": (1, "An instance of this daemon is already running")})
    daemon = mps.Daemon(MpsConfig(enabled=True), tmp_path / "mps", execute)
    with pytest.raises(RuntimeError, match="did not start .* exited 1.*already running"):
        daemon.start()
    pipe = Path(execute.calls[0][2]["CUDA_MPS_PIPE_DIRECTORY"])
    assert not pipe.exists() and daemon.pipe is None


def test_a_daemon_that_stops_answering_leaves_the_count_of_what_was_seen(tmp_path):
    answers = {"get_server_list": (0, "11"), "get_client_list 11": (0, "101")}
    clock = FakeClock()
    daemon = mps.Daemon(MpsConfig(enabled=True), tmp_path / "mps", Recorder(answers), clock=clock)
    daemon.start()
    daemon.observe()
    answers["get_server_list"] = (1, "Cannot find MPS control daemon process")
    clock.advance(10)
    daemon.observe()
    assert daemon.summary()["clients_seen"] == 1
    daemon.stop()


def _config(*overrides: str):
    return load_config(ROOT / "configs/quickstart.yaml", list(overrides))


def test_auto_turns_mps_on_only_where_the_learner_and_a_generator_share_a_gpu(control):
    shared = ["--learner.devices=0", "--generator.devices=1,0", f"--mps.control={control}", "--mps.enabled=auto"]
    assert mps.wanted(_config(*shared)) == (True, "mps.enabled: auto, and the learner and a generator share a GPU")
    apart = _config("--learner.devices=0", "--generator.devices=1", "--mps.enabled=auto", f"--mps.control={control}")
    assert mps.wanted(apart) == (False, "mps.enabled: auto, and no generator shares a GPU with the learner")
    assert not mps.wanted(_config("--mps.enabled=auto", f"--mps.control={control}"))[0]  # no GPUs named
    missing = mps.wanted(_config(*shared[:2], "--mps.enabled=auto", "--mps.control=/nowhere/mps-control"))
    assert missing == (
        False,
        "mps.enabled: auto, and /nowhere/mps-control is not installed: the processes take turns on the GPU",
    )
    assert mps.wanted(_config(*shared[:2])) == (False, "mps.enabled: false")
    assert mps.wanted(_config("--mps.enabled=true")) == (True, "mps.enabled: true")


def test_bad_mps_settings_fail_before_any_process_starts_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"mps.enabled: true needs CUDA MPS's control program, and '/nowhere/x'"):
        mps.check(_config("--mps.enabled=true", "--mps.control=/nowhere/x").mps)
    with pytest.raises(ValueError, match="mps.enabled is for asyncrl run on one machine"):
        mps.check(_config("--mps.enabled=auto").mps, local=False)
    mps.check(_config().mps, local=False)  # off: nothing to check
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
    assert journal[0] == "started" and journal[-1] == "quit"
    assert "get_server_list" in journal and "get_client_list 4242" in journal
    seen: dict[str, str | None] = {}
    for line in (logs / "clients.jsonl").read_text().splitlines():
        seen |= json.loads(line)
    # the learner and the quickstart's one generator, each with its side's share
    assert sorted(seen.values()) == ["60", "90"], seen
    assert summary["mps"]["clients_seen"] == 2
    assert not any(p.name.startswith("asyncrl-mps-") and (p / "control").exists() for p in Path("/tmp").iterdir())
    assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is None  # the launcher's own environment is untouched
