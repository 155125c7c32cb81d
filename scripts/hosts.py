"""Hosts on one machine, for trying a multi-host deployment: network namespaces joined by a bridge.

Each host is a network namespace with its own loopback, one veth link to a
bridge in the root namespace, an address in 198.18.0.0/15 (RFC 2544's
benchmarking range, routed nowhere) and a working folder of its own. The
bridge has no address, so the hosts reach each other and nothing else. A
host's processes run in a mount namespace of their own where every host's
folder but their own is hidden under an empty tmpfs, with a private
``/dev/shm`` and ``TMPDIR`` in their folder: hosts share no files and no
shared memory, only the installed software. Links fail as a cable does:
``cut`` sets the host's end on the bridge down (packets vanish, connections
stay open), ``mend`` sets it up again. Run as root:

    python scripts/hosts.py up --hosts 3           # h1 198.18.0.1, h2 198.18.0.2, h3 198.18.0.3
    python scripts/hosts.py exec h1 -- asyncrl keys secrets/run
    python scripts/hosts.py copy h1 secrets h2 h3  # as scp would
    python scripts/hosts.py add                    # one more host: h4
    python scripts/hosts.py cut h2                 # h2's link goes down (mend h2: back up)
    python scripts/hosts.py kill h3                # every process on h3, by its PID
    python scripts/hosts.py down                   # every namespace, veth and bridge this script made

Tests use :class:`Hosts` as a context manager: leaving it ends every process
on its hosts and removes every namespace, veth and bridge it made, whatever
happened inside. Every name starts with :data:`PREFIX` and a random suffix, so
instances never collide, and ``down`` finds leftovers of any instance by it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "arlh"  # every namespace, veth and bridge made here starts with it (interface names: 15 characters at most)
SUBNET = "198.18.0"  # host i is SUBNET.i/24
DEFAULT_ROOT = Path("/tmp/asyncrl-hosts")
STATE_FILE = "hosts.json"
COMMAND_TIMEOUT_S = 30.0  # any one `ip` command
KILL_TIMEOUT_S = 10.0  # a killed host's processes are gone within this


class HostsError(RuntimeError):
    """An `ip` command failed, or a host was named that does not exist."""


def ip(*args: str) -> str:
    """Run ``ip ARGS`` and return its output; raise :class:`HostsError` with its message if it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    """One host: its network namespace, address, folder, and its link's end on the bridge (``veth``)."""

    name: str
    netns: str
    address: str
    folder: Path
    veth: str
    root: Path  # the folder holding every host's folder, hidden from this host's processes but for its own

    def command(self, args: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """``args`` as run on this host, in its folder; ``env`` is added to the environment.

        ``ip netns exec`` gives the command a mount namespace of its own, so
        the tmpfs mounted over the hosts' folders (and over ``/dev/shm``) is
        seen by this command and its children only. The host's own folder is
        bound back in place from the working directory, which still points
        at it once the tmpfs covers its path. The shell ``exec``s the command,
        so the process started is the command itself, with its own PID.
        """
        settings = {"TMPDIR": str(self.folder / "tmp"), **(env or {})}
        root, mine = shlex.quote(str(self.root)), shlex.quote(str(self.folder))
        script = " && ".join(
            [
                f"cd {mine}",
                f"mount -t tmpfs -o size=1m hidden {root}",
                f"mkdir -p {mine}",
                f"mount --no-canonicalize --bind . {mine}",  # "." as is: canonicalized, it would name the tmpfs
                "mount -t tmpfs -o size=64m shm /dev/shm",
                f"cd {mine}",
                "exec env " + " ".join(shlex.quote(f"{k}={v}") for k, v in settings.items()) + ' "$@"',
            ]
        )
        return ["ip", "netns", "exec", self.netns, "sh", "-c", script, "sh", *args]

    def popen(
        self, args: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``args`` on this host, its output appended to ``log`` (or discarded); returns once the process
        is in the host's namespace, so that :meth:`kill` right after it finds the process."""
        output = open(log, "a") if log is not None else subprocess.DEVNULL  # noqa: SIM115  (the child holds it)
        try:
            proc = subprocess.Popen(
                self.command(args, env), stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            if log is not None:
                output.close()
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while proc.poll() is None and proc.pid not in self.pids():
            if time.monotonic() > deadline:
                proc.kill()
                raise HostsError(f"{self.name}: {args[0]} did not enter the host within {COMMAND_TIMEOUT_S:g}s")
            time.sleep(0.01)  # real time: `ip netns exec` entering the namespace
        return proc

    def run(self, args: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``args`` on this host to its end (at most ``timeout_s``); its exit status and output."""
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout_s)

    def pids(self) -> list[int]:
        """Every process running on this host."""
        return pids_in(self.netns)

    def kill(self) -> None:
        """SIGKILL every process on this host by its PID, as a machine losing power; wait until none is left."""
        kill_in(self.netns)

    def cut(self) -> None:
        """Take this host off the network: its end on the bridge goes down, as a pulled cable."""
        ip("link", "set", self.veth, "down")

    def mend(self) -> None:
        """Put this host back on the network."""
        ip("link", "set", self.veth, "up")


class Hosts:
    """Hosts on one bridge, made by :meth:`add` and all removed by :meth:`close` (or on leaving a ``with``)."""

    def __init__(self, root: str | os.PathLike = DEFAULT_ROOT, instance: str | None = None) -> None:
        self.instance = instance or _new_instance()
        self.root = Path(root) / self.instance
        self.bridge = f"{self.instance}br"
        self.hosts: dict[str, Host] = {}
        self._bridge_made = False

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        if name not in self.hosts:
            raise HostsError(f"no host {name} (there are {', '.join(self.hosts) or 'none'})")
        return self.hosts[name]

    def up(self, count: int) -> list[Host]:
        """Make the bridge (once) and ``count`` more hosts on it."""
        return [self.add() for _ in range(count)]

    def add(self) -> Host:
        """One more host on the bridge, named ``h1``, ``h2``... in order, at ``SUBNET.1``, ``SUBNET.2``..."""
        if not self._bridge_made:
            ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            ip("link", "set", self.bridge, "up")
        number = len(self.hosts) + 1
        if number > 254:
            raise HostsError(f"{SUBNET}.0/24 holds 254 hosts")
        host = Host(
            name=f"h{number}",
            netns=f"{self.instance}-h{number}",
            address=f"{SUBNET}.{number}",
            folder=self.root / f"h{number}",
            veth=f"{self.instance}h{number}",
            root=self.root,
        )
        (host.folder / "tmp").mkdir(parents=True, exist_ok=True)
        self.hosts[host.name] = host
        ip("netns", "add", host.netns)
        ip("-n", host.netns, "link", "set", "lo", "up")
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        self._save()
        return host

    def copy(self, source: str, path: str, targets: Sequence[str]) -> None:
        """Copy ``path`` (relative to host ``source``'s folder) to the same place on each of ``targets``, as scp
        would: the run's CURVE secret, for one."""
        origin = self[source].folder / path
        for name in targets:
            target = self[name].folder / path
            if origin.is_dir():
                shutil.copytree(origin, target, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)

    def close(self) -> None:
        """End every process on these hosts, then remove their namespaces and veths and the bridge: all of it,
        even when a host's processes would not die (that is raised once the rest is gone)."""
        failed: list[str] = []
        for host in self.hosts.values():
            try:
                host.kill()
            except HostsError as exc:
                failed.append(str(exc))
        _remove(
            [h.netns for h in self.hosts.values()],
            [h.veth for h in self.hosts.values()] + ([self.bridge] if self._bridge_made else []),
        )
        (self.root / STATE_FILE).unlink(missing_ok=True)
        if failed:
            raise HostsError("; ".join(failed))

    def _save(self) -> None:
        state = {"instance": self.instance, "hosts": [asdict(h) for h in self.hosts.values()]}
        (self.root / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))

    @classmethod
    def load(cls, root: Path, instance: str | None) -> Hosts:
        """The instance under ``root`` that ``up`` made (the only one there, unless ``instance`` names one)."""
        states = sorted(root.glob(f"{instance or PREFIX + '*'}/{STATE_FILE}"))
        if len(states) != 1:
            found = ", ".join(p.parent.name for p in states) or "none"
            raise HostsError(f"{len(states)} sets of hosts under {root} ({found}): name one with --instance")
        state = json.loads(states[0].read_text())
        hosts = cls(root, state["instance"])
        hosts._bridge_made = True
        for entry in state["hosts"]:
            host = Host(**{**entry, "folder": Path(entry["folder"]), "root": Path(entry["root"])})
            hosts.hosts[host.name] = host
        return hosts


def pids_in(netns: str) -> list[int]:
    """Every process running in the network namespace ``netns``; none once it is gone."""
    try:
        return [int(pid) for pid in ip("netns", "pids", netns).split()]
    except HostsError:
        return []


def kill_in(netns: str, timeout_s: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL every process in ``netns`` by its PID, and wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while pids := pids_in(netns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise HostsError(f"{netns}: processes {pids} outlived SIGKILL for {timeout_s:g}s")
        time.sleep(0.05)  # real time: the kernel reaping the killed processes


def _new_instance() -> str:
    """A prefix no namespace or link has yet: PREFIX and four random hex digits."""
    namespaces, links = _existing()
    taken = " ".join(namespaces + links)
    while True:
        instance = PREFIX + secrets.token_hex(2)
        if instance not in taken:
            return instance


def _existing() -> tuple[list[str], list[str]]:
    """The namespaces and the links whose names start with :data:`PREFIX`."""
    namespaces = [line.split()[0] for line in ip("netns", "list").splitlines() if line.startswith(PREFIX)]
    links = [line.split(": ")[1].split("@")[0] for line in ip("-o", "link", "show").splitlines()]
    return namespaces, [name for name in links if name.startswith(PREFIX)]


def _remove(namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Delete ``namespaces`` (each after killing what runs in it) and ``links``; those already gone are skipped."""
    present_namespaces, present_links = _existing()
    for netns in set(namespaces) & set(present_namespaces):
        kill_in(netns)
        ip("netns", "del", netns)
    for link in links:  # a veth goes with its namespace; the bridge and any veth left over go here
        if link in present_links:
            try:
                ip("link", "del", link)
            except HostsError:
                if link in _existing()[1]:
                    raise


def down_all() -> tuple[list[str], list[str]]:
    """Remove every namespace and link whose name starts with :data:`PREFIX`; what was removed."""
    namespaces, links = _existing()
    _remove(namespaces, links)
    return namespaces, links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where the hosts' folders go")
    parser.add_argument("--instance", help="which set of hosts (the name `up` printed), where several are up")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="make hosts").add_argument("--hosts", type=int, default=3)
    commands.add_parser("add", help="one more host")
    run = commands.add_parser("exec", help="run a command on a host, in its folder")
    run.add_argument("host")
    run.add_argument("args", nargs=argparse.REMAINDER, help="-- COMMAND...")
    copy = commands.add_parser("copy", help="copy a file or folder from one host's folder to others', as scp would")
    copy.add_argument("source", help="the host that has it")
    copy.add_argument("path", help="relative to the hosts' folders")
    copy.add_argument("targets", nargs="+", help="the hosts to copy it to")
    for name, text in [("cut", "take a host off the network"), ("mend", "put it back"), ("kill", "end its processes")]:
        commands.add_parser(name, help=text).add_argument("host")
    commands.add_parser("down", help="remove the hosts (without --instance: every set this script made)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("hosts.py: network namespaces need root", file=sys.stderr)
        return 2
    try:
        return _command(args)
    except HostsError as exc:
        print(f"hosts.py: {exc}", file=sys.stderr)
        return 1


def _command(args: argparse.Namespace) -> int:
    if args.command == "down":
        if args.instance:
            Hosts.load(args.root, args.instance).close()
            return 0
        namespaces, links = down_all()
        for state in args.root.glob(f"{PREFIX}*/{STATE_FILE}"):
            state.unlink()
        print(f"removed {len(namespaces)} namespaces and {len(links)} links")
        return 0
    if args.command == "up":
        hosts = Hosts(args.root)
        made = hosts.up(args.hosts)
        print(f"hosts {hosts.instance}, folders under {hosts.root}:")
    else:
        hosts = Hosts.load(args.root, args.instance)
        made = [hosts.add()] if args.command == "add" else []
    for host in made:
        print(f"{host.name}  {host.address}  {host.folder}  (namespace {host.netns})")
    if args.command == "copy":
        hosts.copy(args.source, args.path, args.targets)
    if args.command in ("cut", "mend", "kill"):
        getattr(hosts[args.host], args.command)()
    if args.command == "exec":
        command = args.args[1:] if args.args[:1] == ["--"] else args.args
        return subprocess.run(hosts[args.host].command(command)).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
