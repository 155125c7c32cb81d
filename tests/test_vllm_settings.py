"""generator.vllm: what reaches vllm.LLM, with the hardware deciding what the config leaves unset."""

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from generators import vllm_engine_args
from generators.vllm_backend import kv_cache_bytes


def test_on_a_gpu_the_defaults_are_vllms_fast_path(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = vllm_engine_args(load_config(None))
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False and args["enable_prefix_caching"] is True
    assert "kv_cache_memory_bytes" not in args and "gpu_memory_utilization" not in args, "vLLM sizes its cache"
    # and the backend does not size it either (a fixed 1 GiB here once left a GPU run 85 requests at a time)
    assert kv_cache_bytes(args.get("kv_cache_memory_bytes")) is None


def test_on_a_cpu_the_engine_is_eager_float32_with_an_explicit_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = vllm_engine_args(load_config(None))
    assert (args["dtype"], args["enforce_eager"], args["enable_prefix_caching"]) == ("float32", True, False)
    assert kv_cache_bytes(args.get("kv_cache_memory_bytes")) == 1 << 30, "vLLM cannot profile a CPU's memory"


def test_settings_and_free_form_engine_args_pass_through(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = load_config(
        None,
        [
            "--generator.vllm.gpu_memory_utilization=0.3",
            "--generator.vllm.max_num_seqs=512",
            "--generator.vllm.kv_cache_memory_bytes=4294967296",
            "--generator.vllm.tensor_parallel_size=2",
            "--model.dtype=float16",
            "--generator.vllm.engine_args={kv_cache_dtype: fp8, enforce_eager: true}",
        ],
    )
    args = vllm_engine_args(config)
    assert (args["gpu_memory_utilization"], args["max_num_seqs"], args["tensor_parallel_size"]) == (0.3, 512, 2)
    assert kv_cache_bytes(args["kv_cache_memory_bytes"]) == 4 << 30
    assert args["dtype"] == "float16", "the generator follows model.dtype unless generator.vllm.dtype is set"
    assert args["kv_cache_dtype"] == "fp8" and args["enforce_eager"] is True, "engine_args win"


@pytest.mark.parametrize(
    "override, key",
    [
        ("--generator.vllm.max_num_seq=4", "generator.vllm"),  # a typo names its section and key
        ("--generator.vllm.gpu_memory_utilization=1.5", "generator.vllm.gpu_memory_utilization"),
        ("--generator.vllm.dtype=fp8", "generator.vllm.dtype"),
    ],
)
def test_bad_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.fixture
def python_gc_thresholds():
    import gc

    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


class StubBackend:
    def __init__(self, *args, **kwargs):
        pass


def test_a_vllm_generator_sets_its_garbage_collector_thresholds_once_the_engine_is_up(
    monkeypatch, python_gc_thresholds
):
    import gc

    import generators
    import generators.vllm_backend

    monkeypatch.setattr(generators.vllm_backend, "VllmBackend", StubBackend)
    monkeypatch.setattr(generators, "require", lambda *args: None)
    generators.open_backend(load_config(None, ["--generator.backend=vllm", "--generator.gc_thresholds=[1234,5,6]"]))
    assert gc.get_threshold() == (1234, 5, 6)
    gc.set_threshold(*python_gc_thresholds)
    generators.open_backend(load_config(None, ["--generator.backend=vllm", "--generator.gc_thresholds=null"]))
    assert gc.get_threshold() == python_gc_thresholds, "null leaves Python's thresholds"
    # the default spares the engine loop Python's collections every 700 allocations
    assert load_config(None).generator.gc_thresholds[0] > 700
