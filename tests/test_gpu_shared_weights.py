"""CUDA IPC between two processes on one GPU: the learner's segment read by another process."""

import subprocess
import sys

import msgspec
import pytest
from conftest import ROOT

from asyncrl.wire.protocol import TensorSpec

pytestmark = pytest.mark.gpu

READER = """
import sys, msgspec, torch
from asyncrl.wire.protocol import SharedHandle
from asyncrl.weights.shared import SharedView, Superseded
handle = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()), type=SharedHandle)
view = SharedView(handle, "cuda")
got = dict(view.read(1, timeout_s=10))
print(got["w"].float().sum().item(), got["w"].dtype, got["w"].device.type, flush=True)
sys.stdin.readline()  # the learner has written v2
try:
    view.read(1, timeout_s=10)
except Superseded:
    print("superseded", flush=True)
"""


def test_another_process_reads_the_learners_gpu_segment():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from asyncrl.weights.shared import SharedSegment

    weight = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    segment = SharedSegment([TensorSpec("w", "bfloat16", (1024, 1024))], "cuda")
    assert segment.handle.kind == "cuda" and segment.handle.gpu_uuid
    segment.write(1, [("w", weight)])
    reader = subprocess.Popen(
        [sys.executable, "-c", READER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=False,
    )
    reader.stdin.write(msgspec.msgpack.encode(segment.handle).hex().encode() + b"\n")
    reader.stdin.flush()
    line = reader.stdout.readline().decode()
    if not line:
        reader.kill()
        pytest.fail(reader.stderr.read().decode()[-3000:])
    total, dtype, device = line.split()
    assert abs(float(total) - weight.float().sum().item()) < 1e-3 and dtype == "torch.bfloat16" and device == "cuda"
    segment.write(2, [("w", weight * 2)])
    out, err = reader.communicate(b"next\n", timeout=60)
    assert reader.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == "superseded"
