"""The Python tool's sandbox: normal use, then every way out we could think of, each refused or killed and reported.

Each test runs under both backends; bwrap's are skipped only where bubblewrap is not installed. The limits are short,
so the file takes seconds; the tests that wait for a limit on purpose are marked realtime.
"""

import glob
import os
import shutil
import socket
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from conftest import wait_for

from asyncrl.envs import sandbox
from asyncrl.envs.sandbox import Sandbox, SandboxError

NO_BWRAP = shutil.which("bwrap") is None
# The checks for processes left behind look at every sandbox on the machine: nothing else here starts one, and
# scripts/test.sh gives each test file to one worker.


@pytest.fixture(
    params=[pytest.param("bwrap", marks=pytest.mark.skipif(NO_BWRAP, reason="bubblewrap is not installed")), "unshare"]
)
def backend(request) -> str:
    return request.param


@pytest.fixture
def box(backend) -> Sandbox:
    return Sandbox(backend=backend, timeout_s=2, cpu_s=1)


def sandbox_processes() -> list[psutil.Process]:
    """Processes of any sandbox, by their command lines: launchers and this module's bootstrap, or the code's."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if sandbox._BOOT in cmdline or cmdline[-3:] == ["-I", "-u", "main.py"]:
            found.append(process)
    return found


def code_processes() -> list[psutil.Process]:
    return [p for p in sandbox_processes() if p.info["cmdline"][-3:] == ["-I", "-u", "main.py"]]


def test_what_the_code_prints_comes_back(box):
    assert box.run("print(2**10)") == "1024\n"
    assert box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)") == "out\nerr\n"


def test_an_exception_reports_its_traceback(box):
    with pytest.raises(SandboxError, match="^exit status 1:\nTraceback") as raised:
        box.run("def answer():\n    raise ValueError('no answer')\n\nanswer()")
    assert 'File "/tmp/sandbox/main.py", line 2, in answer' in str(raised.value)
    assert str(raised.value).endswith("ValueError: no answer\n")


def test_long_output_is_truncated_with_a_note(backend):
    text = Sandbox(backend=backend, output_chars=200).run("print('a' * 5000 + 'b' * 5000)")
    assert text.startswith("a" * 100 + "\n[... output truncated: 10,001 bytes in all")
    assert text.endswith("...]\n" + "b" * 99 + "\n")


def test_a_flood_of_output_keeps_only_its_ends(backend):
    text = Sandbox(backend=backend, output_chars=200).run(
        "import sys\nfor _ in range(50):\n    sys.stdout.write('y' * 2**20)"
    )
    assert "truncated: 52,428,800 bytes in all" in text and len(text) < 300


def test_no_network_but_a_loopback_of_its_own(box):
    """The host's port is free inside, the code reaches what it listens on itself, and nothing further."""
    with socket.create_server(("127.0.0.1", 0)) as host:
        port = host.getsockname()[1]
        code = f"""import socket
server = socket.create_server(("0.0.0.0", {port}))
socket.create_connection(("127.0.0.1", {port})).close()
print("served itself")
socket.create_connection(("1.1.1.1", 53), timeout=1)
"""
        with pytest.raises(SandboxError, match="^exit status 1:\nserved itself\n") as raised:
            box.run(code)
        assert str(raised.value).endswith("Network is unreachable\n")
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.accept()


def test_the_hosts_loopback_is_out_of_reach(box):
    with socket.create_server(("127.0.0.1", 0)) as host:
        with pytest.raises(SandboxError, match="ConnectionRefusedError"):
            box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {host.getsockname()[1]}))")
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.accept()


@pytest.mark.parametrize(
    "path", ["/tmp/../etc/asyncrl_escape", "/tmp/asyncrl_escape_UNIQUE", "/usr/asyncrl_escape", "/asyncrl_escape"]
)
def test_writes_outside_the_working_folder_are_refused(box, path):
    path = path.replace("UNIQUE", uuid.uuid4().hex)  # a fresh name each time (and the same test id everywhere)
    with pytest.raises(SandboxError, match="Read-only file system"):
        box.run(f"open({path!r}, 'w').write('escaped')")
    assert not os.path.exists(path)


def test_the_hosts_files_and_environment_are_out_of_sight(box, tmp_path, monkeypatch):
    """Homes, /tmp, /run and /var are not in the view, and the code gets an environment of its own."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")
    seen = box.run("import os\nprint(os.environ.get('ASYNCRL_TEST_SECRET'), *os.listdir('/'))").split()
    assert seen[0] == "None" and "usr" in seen and not {"home", "run", "var"} & set(seen)
    with pytest.raises(SandboxError, match="FileNotFoundError"):
        box.run(f"open({str(secret)!r}, 'a')")
    assert secret.read_text() == "hunter2"


def test_the_working_folder_is_fresh_bounded_and_gone_afterwards(backend, monkeypatch):
    # a temporary folder of this test's own, which the sandbox can enter (pytest's tmp_path is private to its
    # owner): other tests' sandboxes come and go beside it
    own = tempfile.mkdtemp(prefix="asyncrl-sandbox-test-")
    os.chmod(own, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", own)
    try:
        box = Sandbox(backend=backend, disk_mb=1)
        before = set(glob.glob(f"{own}/asyncrl-sandbox-*"))
        code = "import os\nprint(os.getcwd(), sorted(os.listdir()))\nopen('note.txt', 'w').write('left behind')"
        assert box.run(code) == box.run(code) == "/tmp/sandbox ['main.py']\n"
        with pytest.raises(SandboxError, match="File too large|No space left on device"):
            box.run("open('big', 'wb').write(bytes(2 * 2**20))")
        assert set(glob.glob(f"{own}/asyncrl-sandbox-*")) <= before
    finally:
        shutil.rmtree(own, ignore_errors=True)
    assert not os.path.exists(f"{sandbox.WORKDIR}/note.txt")


def test_it_runs_with_no_capabilities(box):
    code = "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('Cap')])"
    assert box.run(code) == f"{['0000000000000000'] * 5}\n"


def test_seen_from_the_host_it_never_runs_as_root(box):
    """The host's root would be exempt from RLIMIT_NPROC, so the code runs as a user; killing it is reported."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(box.run, "import time\ntime.sleep(1e9)")
        wait_for(lambda: code_processes())
        for process in code_processes():
            assert 0 not in process.uids() and 0 not in process.gids()
            process.kill()
        with pytest.raises(SandboxError, match="^killed by SIGKILL$"):
            running.result()


def test_a_fork_bomb_is_refused_and_leaves_no_process(box):
    with pytest.raises(SandboxError, match=r"BlockingIOError: \[Errno 11\] Resource temporarily unavailable"):
        box.run("import os\nwhile True:\n    os.fork()")
    assert not sandbox_processes()


def test_what_the_code_leaves_running_ends_with_it(box):
    code = """import os, time
if os.fork() == 0:
    os.setsid()
    os.closerange(0, 3)
    time.sleep(1e9)
print("ok")
"""
    assert box.run(code) == "ok\n"
    assert not sandbox_processes()


def test_a_huge_allocation_hits_the_memory_limit(box):
    with pytest.raises(SandboxError, match="^memory limit of 256 MiB exceeded:\nTraceback") as raised:
        box.run("data = bytearray(10 * 2**30)")
    assert str(raised.value).endswith("MemoryError\n")


@pytest.mark.realtime  # 1 s: the wall-clock limit itself is what is tested
def test_a_sleep_is_killed_at_the_time_limit(backend):
    box = Sandbox(backend=backend, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(SandboxError, match="^time limit of 1 s exceeded:\ngoing to sleep\n$"):
        box.run("import time\nprint('going to sleep')\ntime.sleep(1e9)")
    assert 1 <= time.monotonic() - start < 3
    assert not sandbox_processes()


@pytest.mark.realtime  # 1 s of CPU time: RLIMIT_CPU itself is what is tested
def test_a_busy_loop_hits_the_cpu_limit(backend):
    box = Sandbox(backend=backend, timeout_s=10, cpu_s=1)
    start = time.monotonic()
    with pytest.raises(SandboxError, match="^CPU time limit of 1 s exceeded$"):
        box.run("while True:\n    pass")
    assert time.monotonic() - start < 10


def test_network_true_shares_the_hosts_network(backend):
    box = Sandbox(backend=backend, network=True)
    with socket.create_server(("127.0.0.1", 0)) as host:
        assert box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {host.getsockname()[1]}))") == ""
        host.settimeout(5)
        host.accept()[0].close()


def test_the_tools_schema_is_what_chat_templates_need():
    from transformers.utils import get_json_schema

    schema = get_json_schema(sandbox.python)["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["description"].startswith("Run Python code in a fresh sandboxed process")
    tool = Sandbox(timeout_s=3).tool("run_code")
    assert get_json_schema(tool)["function"] == {**schema, "name": "run_code"}
    assert tool("print(6 * 7)") == "42\n"
    assert sandbox.python("print(2**10)") == "1024\n"


def test_a_machine_without_a_sandbox_fails_at_construction(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        Sandbox(backend="docker")
    monkeypatch.setattr(sandbox, "_WORKING", set())
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="bwrap: not installed; unshare: not installed.*apt-get install bubblewrap"):
        Sandbox()
    # a task that gives the model the python tool fails at the generator's start, naming the key, rather than
    # at every tool call of the run
    from asyncrl.config import TaskConfig
    from asyncrl.envs import environment_factory

    sandbox.default_sandbox.cache_clear()
    with pytest.raises(ValueError, match="task.tools: python: no sandbox works here"):
        environment_factory(TaskConfig(env="tools", tools=["python"]), tool_timeout_s=1.0)
    sandbox.default_sandbox.cache_clear()  # made afresh, on a machine with a sandbox, by the next test that needs one
