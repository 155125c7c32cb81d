"""Generator processes: sample rollouts with the current policy and stream them to the buffer.

:func:`open_backend` is the one place that switches on ``generator.backend``.
"""

from __future__ import annotations

import importlib.util

from asyncrl.config import RunConfig
from asyncrl.extras import require
from generators.base import GeneratorBackend


def resolve_backend(name: str) -> str:
    """``auto`` means vLLM where it is installed, transformers elsewhere."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    return name


def open_backend(config: RunConfig) -> GeneratorBackend:
    """The configured generation backend, loaded with the starting weights."""
    name = resolve_backend(config.generator.backend)
    if name == "transformers":
        from generators.hf_backend import TransformersBackend

        return TransformersBackend(config.model.path, config.model.dtype, push=config.push,
                                   push_rank=config.generator.push_rank)
    if name == "vllm":
        require("vllm", "generator.backend: vllm")
        from generators.vllm_backend import VllmBackend

        engine = {"gpu_memory_utilization": config.generator.gpu_memory_utilization} \
            if config.generator.gpu_memory_utilization is not None else {}
        return VllmBackend(config.model.path, config.model.dtype, seed=config.generator.seed, push=config.push,
                           push_rank=config.generator.push_rank, **engine)
    raise NotImplementedError(f"generator.backend: {name!r} is not available in this build")
