"""Generator processes: sample rollouts with the current policy and stream them to the buffer.

:func:`open_backend` is the one place that switches on ``generator.backend``.
"""

from __future__ import annotations

from asyncrl.config import RunConfig
from asyncrl.extras import require, resolve_backend
from generators.base import GeneratorBackend

__all__ = ["open_backend", "resolve_backend", "set_gc_thresholds", "vllm_engine_args"]


def vllm_engine_args(config: RunConfig) -> dict:
    """``vllm.LLM`` arguments from ``generator.vllm``, with the hardware deciding what is left unset."""
    import torch

    v, gpu = config.generator.vllm, torch.cuda.is_available()
    args = {
        "dtype": config.model.resolved_dtype() if v.dtype == "auto" else v.dtype,
        "enforce_eager": (not gpu) if v.enforce_eager is None else v.enforce_eager,
        "enable_prefix_caching": gpu if v.enable_prefix_caching is None else v.enable_prefix_caching,
        "tensor_parallel_size": v.tensor_parallel_size,
        "max_model_len": v.max_model_len,
    }
    for key in ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(v, key) is not None:
            args[key] = getattr(v, key)
    return {**args, **v.engine_args}


def open_backend(config: RunConfig) -> GeneratorBackend:
    """The configured generation backend, loaded with the starting weights."""
    name = resolve_backend(config.generator.backend)
    if name == "transformers":
        from generators.hf_backend import TransformersBackend

        return TransformersBackend(
            config.model.path,
            config.model.resolved_dtype(),
            push=config.push,
            push_rank=config.generator.push_rank,
            lora=config.learner.lora,
        )
    if name == "vllm":
        require("vllm", "generator.backend: vllm")
        from generators.vllm_backend import VllmBackend

        backend = VllmBackend(
            config.model.path,
            seed=config.generator.seed,
            push=config.push,
            push_rank=config.generator.push_rank,
            lora=config.learner.lora,
            **vllm_engine_args(config),
        )
        set_gc_thresholds(config.generator.gc_thresholds)
        return backend
    raise NotImplementedError(f"generator.backend: {name!r} is not available in this build")


def set_gc_thresholds(thresholds: tuple[int, int, int] | None) -> None:
    """Python's garbage-collector thresholds for this process (``generator.gc_thresholds``; None: leave them).

    Set once the engine has started: vLLM freezes the objects of its start-up (``gc.freeze``), and what the
    engine loop makes afterwards is mostly short-lived. At Python's thresholds a young collection runs every
    700 allocations and a full one every hundred of them, which on a GPU is every few decode steps.
    """
    import gc
    import logging

    if thresholds is not None:
        gc.set_threshold(*thresholds)
        logging.getLogger(__name__).info("generator: garbage-collector thresholds %s", tuple(thresholds))
