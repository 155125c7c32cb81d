"""``asyncrl run --ray`` across hosts (network namespaces, ``scripts/hosts.py``): a Ray head on one, a worker joining
from another, as docs/guides/ray.md sets a cluster up. The learner and its addresses are on the head's host, the
generator actor on the other, which shares no folder with it: its weights come over the network."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, accounted
from test_hosts import hosts  # noqa: F401  (the fixture: hosts on a bridge, removed after the test)

pytest.importorskip("ray")
# One Ray instance at a time (tests/test_ray.py), and a Ray cluster takes a while to start: slow.
pytestmark = [pytest.mark.slow, pytest.mark.alone]
RAY_PORT = 6379
TOKEN = {"RAY_AUTH_MODE": "token"}  # the cluster's token authentication, as docs/guides/ray.md turns it on


def _ray_token() -> None:
    """The token every node and the driver present (``~/.ray/auth_token``), made once as the guide says."""
    if not (Path.home() / ".ray" / "auth_token").exists():
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        subprocess.run([ray, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)


def _on(host, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    done = subprocess.run(host.command(args, TOKEN), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{host.name} {' '.join(args[:3])}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


def test_a_ray_cluster_across_hosts_runs_the_generator_on_the_other_host(hosts, tmp_path, request):  # noqa: F811
    head, worker = hosts["h1"], hosts.add()
    _ray_token()
    bin_dir = Path(sys.executable).parent
    # Each node's session files in a short folder of its own (their sockets' paths must fit in 107 bytes)
    temp = {host.name: Path(f"/tmp/{hosts.instance}-{host.name}") for host in (head, worker)}
    request.addfinalizer(lambda: [shutil.rmtree(folder, ignore_errors=True) for folder in temp.values()])
    start = [str(bin_dir / "ray"), "start", "--num-cpus", "1", "--disable-usage-stats"]
    _on(
        head,
        [*start, f"--temp-dir={temp['h1']}", "--head", "--node-ip-address", head.address, "--port", str(RAY_PORT)],
        120,
    )
    join = ["--address", f"{head.address}:{RAY_PORT}", "--node-ip-address", worker.address]
    _on(worker, [*start, f"--temp-dir={temp['h2']}", *join], 120)
    keys = tmp_path / "secrets"  # the same path on every host, as the guide has them copied
    subprocess.run([str(bin_dir / "asyncrl"), "keys", str(keys / "run")], check=True, capture_output=True)
    secret = str(keys / "run.key_secret")
    run_dir = head.folder / "run"
    a = head.address
    run = [str(bin_dir / "asyncrl"), "run", "configs/quickstart.yaml", "--ray", "--ray-address", f"{a}:{RAY_PORT}"]
    run += ["--run-dir", str(run_dir), "--learner.total_steps=60", "--generator.replicas=1"]
    run += [f"--buffer.address=tcp://{a}:5555", f"--coordinator.address=tcp://{a}:5556"]
    run += [f"--coordinator.weights_address=tcp://{a}:5557", f"--buffer.curve_secret_file={secret}"]
    run += [f"--coordinator.curve_secret_file={secret}", "--learner.torch_threads=1", "--generator.torch_threads=1"]
    # From the checkout: processes start in the driver's working directory on every node, as the guide says.
    done = _on(head, ["sh", "-c", f'cd "{ROOT}" && exec "$@"', "sh", *run], 300)
    placed = re.findall(r"generator-0: running as pid \d+ on (\S+)", done.stdout + done.stderr)
    assert placed == [worker.address], done.stdout[-3000:]
    consumed = accounted(run_dir)
    assert len(consumed) == 60 * 128 and {c["generator"] for c in consumed} == {"gen-0"}
    assert not (worker.folder / "run").exists(), "the worker has its own folder: nothing written there by the learner"
