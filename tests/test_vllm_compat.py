"""The vLLM adapter: each function against the installed vLLM, and the loud check at import when an internal moved.

The engine-level functions (requests, steps, reloads on a live engine) run in
tests/test_vllm_backend.py; here only what needs no engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from generators import vllm_compat  # noqa: E402


def test_imports_and_names_the_installed_version():
    assert vllm_compat._internals().version == vllm.__version__
    assert ">=0.26,<0.33" in vllm_compat.SUPPORTED


def test_engine_runs_in_this_process_unless_the_user_chose(monkeypatch):
    assert vllm_compat.IN_PROCESS_ENV in vllm.envs.environment_variables
    monkeypatch.delenv(vllm_compat.IN_PROCESS_ENV, raising=False)
    vllm_compat.run_engine_in_this_process()
    assert os.environ[vllm_compat.IN_PROCESS_ENV] == "0"
    monkeypatch.setenv(vllm_compat.IN_PROCESS_ENV, "1")
    vllm_compat.run_engine_in_this_process()
    assert os.environ[vllm_compat.IN_PROCESS_ENV] == "1"


def test_cpu_attention_head_sizes():
    from vllm.platforms import current_platform

    sizes = vllm_compat.cpu_attention_head_sizes()
    if not current_platform.is_cpu():
        assert sizes is None
        return
    assert 32 in sizes and 128 in sizes and 16 not in sizes  # tests/test_vllm_backend.py relies on 32 and 16


def test_final_only_output_kind_is_accepted_by_sampling_params():
    from vllm.sampling_params import RequestOutputKind

    kind = vllm_compat.final_only_output_kind()
    assert kind is RequestOutputKind.FINAL_ONLY
    assert vllm.SamplingParams(n=2, output_kind=kind).output_kind is kind


def test_weight_version_spans():
    from vllm.outputs import CompletionOutput

    plain = CompletionOutput(index=0, text="", token_ids=[1, 2], cumulative_logprob=None, logprobs=None)
    if not vllm_compat.labels_weight_versions():
        assert vllm_compat.weight_version_spans(plain) == []
        return
    from vllm.outputs import WeightVersionSpan

    plain.weight_versions = None
    assert vllm_compat.weight_version_spans(plain) == []
    plain.weight_versions = [WeightVersionSpan("3", 0, 2), WeightVersionSpan("4", 2, 5)]
    assert vllm_compat.weight_version_spans(plain) == [(0, 2, 3), (2, 5, 4)]


def test_worker_functions_call_the_worker_as_vllm_expects():
    calls = []
    model = SimpleNamespace(load_weights=lambda tensors: calls.append(("load_weights", list(tensors))))
    worker = SimpleNamespace(
        rank=3,
        model_runner=SimpleNamespace(device=torch.device("cpu"), get_model=lambda: model),
        vllm_config=SimpleNamespace(quant_config=None, model_config=SimpleNamespace(use_mla=False)),
        reload_weights=lambda **kwargs: calls.append(
            ("reload_weights", {k: list(v) if k == "weights_iterator" else v for k, v in kwargs.items()})
        ),
    )
    tensors = [("w", torch.ones(1))]
    assert vllm_compat.worker_rank(worker) == 3 and vllm_compat.worker_device(worker).type == "cpu"
    assert not vllm_compat.needs_full_reload(worker)
    # MLA attention derives its absorbed matrices after loading, which only vLLM's reload runs; so does quantization
    mla = SimpleNamespace(vllm_config=SimpleNamespace(quant_config=None, model_config=SimpleNamespace(use_mla=True)))
    quantized = SimpleNamespace(vllm_config=SimpleNamespace(quant_config=object(), model_config=SimpleNamespace()))
    assert vllm_compat.needs_full_reload(mla) and vllm_compat.needs_full_reload(quantized)
    vllm_compat.reload_weights_from_folder(worker, "/some/folder")
    vllm_compat.reload_weights_from_tensors(worker, tensors)
    vllm_compat.load_weights_directly(worker, tensors)
    assert calls == [
        ("reload_weights", {"weights_path": "/some/folder"}),
        ("reload_weights", {"weights_iterator": tensors}),
        ("load_weights", tensors),
    ]


def test_undo_partial_reload_restores_the_model_for_the_next_reload():
    """vLLM's layer-wise reload on a plain module: fail half-way, undo, then a whole reload lands."""
    from vllm.model_executor.model_loader.reload import layerwise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))

    def start_reload() -> None:
        layerwise.record_metadata_for_reloading(model)
        layerwise.initialize_layerwise_reload(model)

    start_reload()
    assert any(p.is_meta for p in model.parameters())
    model[0].weight.weight_loader(model[0].weight, torch.full((4, 4), 9.0))  # half a layer, then "an error"
    vllm_compat.undo_partial_reload(worker)
    for name, p in model.named_parameters():
        assert not p.is_meta and torch.equal(p, before[name]), name
    assert len(layerwise.LOADING_LAYERS) == 0

    start_reload()
    for name, p in list(model.named_parameters()):
        p.weight_loader(p, torch.full_like(before[name], 2.0))
    layerwise.finalize_layerwise_reload(model, None)
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())


# --- the check at import ------------------------------------------------------------------------

# Each case breaks one internal in a fresh interpreter, imports the adapter, and reports what it raised.
CHECK_SCRIPT = r"""
import importlib, json, sys
import vllm
import generators.vllm_compat  # every target imported, and the check passes
from vllm.envs import environment_variables
from vllm.model_executor.model_loader.reload import layerwise
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
import vllm.outputs

del sys.modules["generators.vllm_compat"]
reload_weights = GPUModelRunner.reload_weights
saved = {"kernel": layerwise._place_kernel_tensors, "env": environment_variables["VLLM_ENABLE_V1_MULTIPROCESSING"],
         "span": getattr(vllm.outputs, "WeightVersionSpan", None)}


def attribute():
    del layerwise._place_kernel_tensors


def signature():
    GPUModelRunner.reload_weights = lambda self, *args, **kwargs: None


def env():
    del environment_variables["VLLM_ENABLE_V1_MULTIPROCESSING"]


def span():
    del vllm.outputs.WeightVersionSpan


def restore():
    layerwise._place_kernel_tensors = saved["kernel"]
    GPUModelRunner.reload_weights = reload_weights
    environment_variables["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved["env"]
    if saved["span"] is not None:
        vllm.outputs.WeightVersionSpan = saved["span"]


cases = {"attribute": [attribute], "signature": [signature], "env": [env], "all": [attribute, signature, env],
         "restored": []}
if saved["span"] is not None:  # the engine labels versions: its spans must be there too
    cases["span"] = [span]
out = {"version": vllm.__version__}
for name, breaks in cases.items():
    for do in breaks:
        do()
    try:
        importlib.import_module("generators.vllm_compat")
        out[name] = None
    except Exception as error:
        out[name] = {"type": type(error).__name__, "import_error": isinstance(error, ImportError),
                     "message": str(error)}
    restore()
    sys.modules.pop("generators.vllm_compat", None)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def broken() -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "case, names",
    [
        ("attribute", ["_place_kernel_tensors"]),
        ("signature", ["GPUModelRunner.reload_weights", "weights_iterator", "weights_path"]),
        ("env", ["VLLM_ENABLE_V1_MULTIPROCESSING"]),
        ("span", ["WeightVersionSpan"]),
        ("all", ["_place_kernel_tensors", "weights_path", "VLLM_ENABLE_V1_MULTIPROCESSING"]),
    ],
)
def test_import_fails_loudly_when_an_internal_moved(broken, case, names):
    if case not in broken:
        pytest.skip(f"the installed vLLM {broken['version']} does not label weight versions")
    error = broken[case]
    assert error is not None, f"{case}: importing vllm_compat passed with a vLLM internal missing"
    assert error["type"] == "VllmIncompatible" and error["import_error"]
    message = error["message"]
    assert f"installed vLLM {broken['version']}" in message and ">=0.26,<0.33" in message
    for name in names:
        assert name in message, (name, message)


def test_import_passes_once_the_internals_are_back(broken):
    assert broken["restored"] is None


def test_without_vllm_the_backend_imports_and_names_the_extra(python):
    """Test-only installs (no vLLM) import every module; using the backend then says what to install."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import generators.vllm_backend, generators.vllm_push\n"
        "from generators import vllm_compat\n"
        "from asyncrl.extras import MissingExtra\n"
        "try:\n    vllm_compat.cpu_attention_head_sizes()\n"
        "except MissingExtra as error:\n    print(error)\n"
    )
    run = subprocess.run([python, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs vllm, which is not installed" in run.stdout
