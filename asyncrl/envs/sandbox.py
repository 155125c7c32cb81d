"""A tool that runs a model's Python code in a sandboxed process: ``python(code)``, or ``Sandbox(...).tool()``.

Each call starts a fresh interpreter (this one, in isolated mode ``-I``) in new user, PID, mount, network, IPC and
UTS namespaces, unprivileged, with no capabilities and under limits on CPU time, memory, file size and processes.
It sees the system directories, a few files of /etc and the Python installation, read-only, and writes only to its
working folder /tmp/sandbox, a tmpfs that vanishes with it. bubblewrap (``bwrap`` 0.8 or newer) builds the
namespaces; with util-linux's ``unshare``, the fallback, this module run as a script builds the view itself. A
refusal or failure raises SandboxError, whose message is for the model: the caller makes it the tool's error.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

WORKDIR = "/tmp/sandbox"
NOBODY = 65534
_BOOT = os.path.abspath(__file__)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("ld.so.cache", "localtime", "passwd", "group", "nsswitch.conf", "hosts", "resolv.conf", "ssl/certs")
_DEVICES = ("null", "zero", "full", "random", "urandom")
# One thread per numerical library and two malloc arenas: each thread reserves address space that memory_mb bounds.
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
_ENV |= {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
_BACKENDS = {"auto": ("bwrap", "unshare"), "bwrap": ("bwrap",), "unshare": ("unshare",)}
_WORKING: set[tuple[str, bool]] = set()  # (backend, network) pairs that have run a program in this process
_PROBE_S = 30.0  # a first start may read the interpreter from a cold disk
_REAP_S = 10.0  # for the kernel to end a PID namespace whose init was killed


class SandboxError(RuntimeError):
    """The sandboxed code was refused, stopped or failed; the message says which, for the model to read."""


@dataclasses.dataclass
class Sandbox:
    """Limits for running a model's code, and the backend that enforces them; ``tool()`` makes the tool function.

    ``timeout_s`` is wall-clock time and ``cpu_s`` CPU time (RLIMIT_CPU). ``memory_mb`` bounds each process's address
    space (RLIMIT_AS: a large allocation fails with MemoryError) and ``max_processes`` (RLIMIT_NPROC, threads too)
    their number, so the code uses at most their product. ``disk_mb`` bounds the working folder. ``backend`` is
    "bwrap", "unshare" or "auto", the first that works: construction runs a program once per backend and process, so
    that a machine without a working sandbox fails here, naming what to install.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 256
    disk_mb: int = 64
    max_processes: int = 16
    output_chars: int = 2000
    network: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, not {self.backend!r}")
        problems = []
        for name in _BACKENDS[self.backend]:
            if not shutil.which(name):
                problems.append(f"{name}: not installed")
                continue
            try:
                if (name, self.network) in _WORKING or self._launch(name, "print('ok')", _PROBE_S) == "ok\n":
                    _WORKING.add((name, self.network))
                    self.backend = name
                    return
            except (SandboxError, FileNotFoundError) as error:
                problems.append(f"{name}: {error}")
        raise SandboxError(f"no sandbox works here ({'; '.join(problems)}); apt-get install bubblewrap")

    def run(self, code: str) -> str:
        """Runs ``code`` as a script and returns what it printed; SandboxError says how it failed or was stopped."""
        return self._launch(self.backend, code, self.timeout_s)

    def tool(self, name: str = "python") -> Callable[[str], str]:
        """A tool function for a chat template's ``tools``, documented like ``python``, that runs with these limits."""

        def run_python(code: str) -> str:
            return self.run(code)

        run_python.__name__ = run_python.__qualname__ = name
        run_python.__doc__ = python.__doc__
        return run_python

    def _launch(self, backend: str, code: str, timeout_s: float) -> str:
        spec = {"executable": sys.executable, **dataclasses.asdict(self)}
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as folder:
            stdin.write(code.encode())
            stdin.seek(0)
            argv = _command(backend, spec, folder)
            status, output, timed_out = _execute(argv, stdin, timeout_s, 4 * self.output_chars)
        text = output.text(self.output_chars)
        if timed_out or status != 0:
            what = f"time limit of {timeout_s:g} s exceeded" if timed_out else self._failure(status, text)
            raise SandboxError(f"{what}:\n{text}" if text else what)
        return text

    def _failure(self, status: int, text: str) -> str:
        """What ended the code, from the launcher's status: 128 + the signal's number when a signal killed it."""
        if status == 128 + signal.SIGXCPU:
            return f"CPU time limit of {self.cpu_s} s exceeded"
        if text.rstrip().rpartition("\n")[2].startswith("MemoryError"):
            return f"memory limit of {self.memory_mb} MiB exceeded"
        if status - 128 in {s.value for s in signal.Signals}:
            return f"killed by {signal.Signals(status - 128).name}"
        return f"exit status {status}"


def python(code: str) -> str:
    """Run Python code in a fresh sandboxed process and return what it prints.

    The process has no network, can write only to its working folder, and is stopped at its time and memory limits.

    Args:
        code: A complete Python script; print the values you want to see.
    """
    return default_sandbox().run(code)


default_sandbox = functools.cache(Sandbox)  # made on first use (or a generator's start), not at import


def _command(backend: str, spec: dict[str, Any], folder: str) -> list[str]:
    """The launcher's command line; ``folder``, an empty folder, is where unshare's view or root's stage is built.

    Root never runs the code: the host's root is exempt from RLIMIT_NPROC, and its fork bomb took every PID of the
    host. Under unshare the code drops to nobody once the view is built. Root starts bwrap as nobody, once the view
    is bound where nobody can reach it (a Python under /root, say) in a mount namespace of its own (``_stage``).
    """
    as_root = os.geteuid() == 0
    if backend == "unshare":
        setpriv = shutil.which("setpriv")  # --pdeathsig: unshare ends with this process, then --kill-child the rest
        argv = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        argv += [shutil.which("unshare") or "unshare", "--mount", "--pid", "--ipc", "--uts", "--kill-child"]
        argv += (["--user", "--map-root-user"] if not as_root else []) + ([] if spec["network"] else ["--net"])
        spec |= {"root": folder, "view": _view(), "as_root": as_root}
        return argv + [sys.executable, "-I", _BOOT, json.dumps(spec)]
    argv = _bwrap(spec, folder if as_root else "") + [sys.executable, "-I", _BOOT, json.dumps(spec)]
    if not as_root:
        return argv
    stage = {"stage": folder, "view": [*_view(), ("bind", _BOOT)], "argv": argv}
    return [shutil.which("unshare") or "unshare", "--mount", "--", sys.executable, "-I", _BOOT, json.dumps(stage)]


def _bwrap(spec: dict[str, Any], stage: str) -> list[str]:
    """bubblewrap's command line up to the program; the view's sources are under ``stage`` ("" when unstaged).

    ``--unshare-user`` as well as ``--unshare-all``, which only tries one, as ``--uid`` needs it. ``--disable-userns``
    closes a door to kernel bugs, ``--die-with-parent`` ends the sandbox with this process, ``--new-session`` keeps
    the code off any terminal, and the root and /dev are remounted read-only once the view is in place. With
    ``--as-pid-1``, bwrap exits only once the namespace's last process has: bwrap's own init would let it exit first.
    """
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1"]
    argv += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    argv += ["--share-net"] if spec["network"] else []
    for kind, path in (*_view(), ("bind", _BOOT)):
        argv += ["--symlink", os.readlink(path), path] if kind == "link" else ["--ro-bind", stage + path, path]
    argv += ["--dev", "/dev", "--proc", "/proc", "--size", str(spec["disk_mb"] << 20), "--tmpfs", WORKDIR]
    return argv + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--"]


@functools.cache
def _view() -> tuple[tuple[str, str], ...]:
    """What the code sees, read-only: ("bind", path), or ("link", path) for a top-level symlink such as /lib.

    The system directories, a few files of /etc, and the folders this interpreter reads in ``-I`` mode. Homes,
    /tmp, /run and /var stay out: they hold secrets, and Unix sockets that a read-only mount does not guard.
    """
    script = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]))"
    found = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True)
    view = [("link" if os.path.islink(p) else "bind", p) for p in _SYSTEM_DIRS if os.path.lexists(p)]
    view += [("bind", f"/etc/{name}") for name in _ETC if os.path.exists(f"/etc/{name}")]
    for path in sorted({os.path.normpath(p) for p in json.loads(found.stdout) if os.path.isabs(p)}, key=len):
        if os.path.exists(path) and not any(path == p or path.startswith(p + "/") for _, p in view):
            view.append(("bind", path))
    return tuple(view)


class _Output:
    """The head and the tail of a process's output, so that a flood of printing costs bounded memory."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep, self.head, self.tail, self.total = keep_bytes, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = max(self.keep - len(self.head), 0)
        self.head += chunk[:room]
        self.tail += chunk[room:]
        del self.tail[: -self.keep]

    def text(self, chars: int) -> str:
        """The output, or its first and last ``chars // 2`` characters around a note that it was truncated."""
        head = tail = (self.head + self.tail).decode(errors="replace")
        if self.total == len(self.head) + len(self.tail) and len(head) <= chars:
            return head
        if self.total > len(self.head) + len(self.tail):
            head, tail = self.head.decode(errors="replace"), self.tail.decode(errors="replace")
        half, note = max(chars // 2, 1), f"[... output truncated: {self.total:,} bytes in all, the middle left out ...]"
        return f"{head[:half]}\n{note}\n{tail[-half:]}"


def _execute(argv: list[str], stdin: IO[bytes], timeout_s: float, keep_bytes: int) -> tuple[int, _Output, bool]:
    """Runs the launcher ``argv``, reading its output until it ends or ``timeout_s`` passes; says if it timed out.

    The launcher holds the output pipe until it exits, which it does once every process of its namespaces has ended.
    """
    deadline, output, poller = time.monotonic() + timeout_s, _Output(keep_bytes), select.poll()
    pipe, both = subprocess.PIPE, subprocess.STDOUT
    with subprocess.Popen(argv, stdin=stdin, stdout=pipe, stderr=both, env=_ENV, start_new_session=True) as launcher:
        assert launcher.stdout is not None
        fd, ended = launcher.stdout.fileno(), False
        poller.register(fd, select.POLLIN)
        while not ended and (left := deadline - time.monotonic()) > 0:
            if poller.poll(left * 1000):
                chunk = os.read(fd, 1 << 16)
                output.add(chunk)
                ended = not chunk
        try:
            launcher.wait(max(deadline - time.monotonic(), 0) if ended else 0)
        except subprocess.TimeoutExpired:
            _kill(launcher)
            ended = False
    return launcher.returncode, output, not ended


def _kill(launcher: subprocess.Popen) -> None:
    """Kills the launcher's child, the init of the sandbox's PID namespace, so that the kernel kills the rest.

    The launcher exits once it has reaped that init, and the kernel lets it only once the rest is gone.
    """
    import psutil  # here, so that the part of this module that runs in the sandbox needs the standard library only

    with contextlib.suppress(psutil.NoSuchProcess):
        for init in psutil.Process(launcher.pid).children():
            init.kill()
    try:
        launcher.wait(_REAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


# What follows runs as ``python -I sandbox.py SPEC``: as root, to stage bwrap's view; under bwrap, to set the limits
# and start the code; under unshare, as PID 1, to build the view and drop privileges first.

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MNT_DETACH = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x2
_ATTR_RDONLY, _ATTR_NOSUID, _ATTR_NODEV, _AT_RECURSIVE = 0x1, 0x2, 0x4, 0x8000
_SYS_PIVOT_ROOT, _SYS_MOUNT_SETATTR = {"x86_64": 155, "aarch64": 41}, 442  # 442 on every architecture
_CLONE_NEWUSER, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 0x10000000, 4, 24, 38
_LIBC = ctypes.CDLL(None, use_errno=True)


def _stage(spec: dict[str, Any]) -> None:
    """As root in a mount namespace of its own, binds the view where nobody can reach it, then runs bwrap as nobody."""
    _mount("tmpfs", spec["stage"], "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=1m")
    for path in (path for kind, path in spec["view"] if kind == "bind"):
        _bind(path, spec["stage"] + path)
    _become_nobody(own_user_namespace=False)
    os.execv(spec["argv"][0], spec["argv"])


def _boot(spec: dict[str, Any]) -> None:
    """Writes the code (its stdin) to main.py in the working folder, sets the limits and runs it."""
    code = sys.stdin.buffer.read()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if unshare := "root" in spec:
        _enter_view(spec)
    if child := os.fork():  # this process is PID 1: when it exits, the kernel ends whatever the code left running
        if unshare:
            _drop_capabilities()
        os._exit(_reap(child))
    os.setsid()
    if unshare:
        if spec["as_root"]:
            _become_nobody(own_user_namespace=True)
        _drop_capabilities()
    with open(f"{WORKDIR}/main.py", "wb") as file:
        file.write(code)
    os.chdir(WORKDIR)
    mib, cpu = 1 << 20, resource.RLIMIT_CPU  # CPU: SIGXCPU at cpu_s, SIGKILL a second later
    limits = {cpu: spec["cpu_s"], resource.RLIMIT_AS: spec["memory_mb"] * mib, resource.RLIMIT_CORE: 0}
    limits |= {resource.RLIMIT_FSIZE: spec["disk_mb"] * mib, resource.RLIMIT_NPROC: spec["max_processes"]}
    for limit, soft in limits.items():
        hard, ceiling = soft + (limit == cpu), resource.getrlimit(limit)[1]
        resource.setrlimit(limit, (soft, hard) if ceiling == resource.RLIM_INFINITY else (min(soft, ceiling),) * 2)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.execv(spec["executable"], [spec["executable"], "-I", "-u", "main.py"])


def _enter_view(spec: dict[str, Any]) -> None:
    """Builds the view on a tmpfs at ``spec["root"]``, moves into it and makes it read-only but for a few parts.

    pivot_root, not chroot: the old root is unmounted, so that no chroot trick climbs back to it.
    """
    root = spec["root"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=1m")
    for kind, path in [*spec["view"], *(("bind", f"/dev/{name}") for name in _DEVICES)]:
        if kind == "link":
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        else:
            _bind(path, root + path)
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.makedirs(f"{root}/proc")
    _mount("proc", f"{root}/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.makedirs(root + WORKDIR)
    _mount("tmpfs", root + WORKDIR, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={spec['disk_mb']}m")
    os.chdir(root)
    _check(_LIBC.syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_LIBC.umount2(b".", _MNT_DETACH), "umount the old root")
    os.chdir("/")
    _set_attributes("/", _AT_RECURSIVE, set_=_ATTR_RDONLY | _ATTR_NOSUID | _ATTR_NODEV)
    for path in (WORKDIR, "/proc"):  # /proc stays writable, as under bwrap, for /proc/self/uid_map
        _set_attributes(path, 0, clear=_ATTR_RDONLY)
    for name in _DEVICES:
        _set_attributes(f"/dev/{name}", 0, clear=_ATTR_RDONLY | _ATTR_NODEV)
    if not spec["network"]:  # bring up lo, as bwrap does: SIOCSIFFLAGS with IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock, 0x8914, struct.pack("16sh22x", b"lo", 0x1 | 0x8 | 0x40))


def _bind(source: str, target: str) -> None:
    os.makedirs(target if os.path.isdir(source) else os.path.dirname(target), exist_ok=True)
    if not os.path.isdir(source):
        open(target, "ab").close()
    _mount(source, target, None, _MS_BIND | _MS_REC)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [s.encode() if s else None for s in (source, target, fstype, data)]
    _check(_LIBC.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]), f"mount {target}")


def _set_attributes(path: str, flags: int, set_: int = 0, clear: int = 0) -> None:
    """mount_setattr(2): one call makes a whole tree read-only, keeping the flags a user namespace cannot drop."""
    attr = (ctypes.c_uint64 * 4)(set_, clear, 0, 0)  # struct mount_attr: set, clear, propagation, userns_fd
    size = ctypes.c_size_t(ctypes.sizeof(attr))
    _check(_LIBC.syscall(_SYS_MOUNT_SETATTR, -100, path.encode(), flags, attr, size), f"mount_setattr {path}")


def _become_nobody(own_user_namespace: bool) -> None:
    """Drops from the host's root to nobody; a user namespace of its own makes RLIMIT_NPROC count this run alone."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if not own_user_namespace:
        return
    _check(_LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "PR_SET_DUMPABLE")  # /proc/self is root's until then
    _check(_LIBC.unshare(_CLONE_NEWUSER), "unshare a user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} {NOBODY} 1"), ("gid_map", f"{NOBODY} {NOBODY} 1")):
        Path(f"/proc/self/{name}").write_text(text)


def _drop_capabilities() -> None:
    """Empties the bounding set, then this process's sets, so that neither it nor what it starts regains any."""
    for capability in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
        _check(_LIBC.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0), "PR_CAPBSET_DROP")
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # version 3, this process
    _check(_LIBC.capset(header, data), "capset")
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def _reap(child: int) -> int:
    """Waits as PID 1, reaping orphans as well, until ``child`` ends; returns its status as a shell reports it."""
    while (ended := os.wait())[0] != child:
        pass
    code = os.waitstatus_to_exitcode(ended[1])
    return code if code >= 0 else 128 - code


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    _stage(spec) if "stage" in spec else _boot(spec)
