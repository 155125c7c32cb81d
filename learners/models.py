"""The HF model the learner trains, and the learner settings settled from it and the machine before any engine.

How a policy, reference or critic loads (``model.dtype``, no dropout, the
learner's attention), and what ``auto`` and unset learner settings become:
the ZeRO stage, packed or padded rows, Liger's kernels. They are settled here,
once, so the DeepSpeed engine (:mod:`learners.engine`) and every model built
after it see the same answers.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import TYPE_CHECKING

import torch

from asyncrl.config import LearnerConfig, ModelConfig
from learners.packing import check_packable, has_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def zero_stage(config: LearnerConfig, dtype: str | None = None) -> int:
    """``learner.zero_stage``, or when unset: 3 with several ranks; for one, 1 with bf16 weights, else 0.

    One rank gains no memory from ZeRO-3 and pays for its hooks: on one H200
    the story-arithmetic learner step took 1.26 s under ZeRO-3 and 0.61 s
    without it (bench/README.md). With bf16 weights (``dtype``) one rank takes
    stage 1, where DeepSpeed's bf16 optimizer keeps the fp32 master weights and
    gradients in flat buffers: without ZeRO its 16-bit optimizer checks, copies
    and clips every tensor on its own and waits for the GPU after each check.
    For SmolLM2-135M's 272 tensors that was 282 waits in a step on one H100,
    and 6,500 operations for the optimizer's step against 1,100 at stage 1
    (counted on CPU; bench/README.md).
    """
    if config.zero_stage is not None:
        return config.zero_stage
    if world_size() > 1:
        return 3
    return 1 if dtype == "bfloat16" else 0


def world_size() -> int:
    """The learner group's size (1 before the process group starts)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _attention(config: LearnerConfig) -> dict:
    """``attn_implementation`` for transformers, when the config names one."""
    if config.attn_implementation == "varlen":
        import learners.attention  # noqa: F401  (registers the name with transformers)
    return {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}


def load_causal_lm(config: LearnerConfig, model_config: ModelConfig, random_init: bool = False) -> torch.nn.Module:
    """The HF causal LM at ``model.path``, as every learner model loads: ``model.dtype``, the learner's attention.

    ``random_init``: random weights of the checkpoint's shape (``model.random_init``), built on the GPU where
    there is one. With ``learner.disable_dropout`` the model has no dropout, as the generators sample with none:
    its config's dropout probabilities are 0 before it is built (Llama and others read ``attention_dropout``
    in their forward, not through a module), and every ``torch.nn.Dropout`` (a custom model's too) gets p 0.
    Train mode then changes nothing in the forward, so the learner's log-probs are the generators' up to
    numerics from the first step (the ratio, ``mismatch_kl``, the KL to the reference).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = DTYPES[model_config.resolved_dtype()]
    hf_config = AutoConfig.from_pretrained(model_config.path)
    if config.disable_dropout:
        zeroed = zero_dropout(hf_config)
        if zeroed:
            log.info("learner.disable_dropout: %s set to 0", ", ".join(zeroed))
    if random_init:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **_attention(config))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_config.path, config=hf_config, dtype=dtype, **_attention(config)
        )
    if config.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model


def zero_dropout(hf_config: PretrainedConfig) -> list[str]:
    """Set every dropout probability in ``hf_config`` and its sub-configs to 0.0; returns the names that were not 0.

    A probability is a float field named ``*dropout*`` or ``*_pdrop`` (GPT-2's ``attn_pdrop``, OPT's
    ``attention_dropout``, T5's ``dropout_rate``); flags such as ``use_dropout`` are bools and stay.
    """
    from transformers import PretrainedConfig

    zeroed = []
    for name, value in list(vars(hf_config).items()):
        if isinstance(value, PretrainedConfig):  # a multimodal model's text_config, vision_config
            zeroed += [f"{name}.{inner}" for inner in zero_dropout(value)]
        elif isinstance(value, float) and ("dropout" in name or name.endswith("_pdrop")):
            if value:
                zeroed.append(name)
            setattr(hf_config, name, 0.0)
    return zeroed


def resolve_packing(config: LearnerConfig, model_config: ModelConfig) -> None:
    """Settle ``learner.pack_sequences: auto`` in ``config``, and the attention it implies, before any engine is built.

    Packed rows under ``varlen`` where torch's flash varlen kernel runs
    (:func:`learners.attention.kernel_unavailable`: a CUDA GPU of compute
    capability 8.0 or later, a torch whose ``varlen_attn`` takes ``scale``
    and ``window_size``, bf16 or fp16 weights), no other attention is asked
    for and the model has no sliding-window layers; padded rows otherwise.
    ``attn_implementation: varlen`` asked for on a GPU where the kernel
    cannot run, or for a model with sliding-window layers, is an error here
    rather than at the first step.
    """
    asked_varlen = config.attn_implementation == "varlen"
    if config.pack_sequences != "auto" and not asked_varlen:
        return
    from transformers import AutoConfig

    from learners.attention import kernel_unavailable

    hf_config = AutoConfig.from_pretrained(model_config.path)
    reason = kernel_unavailable(model_config.resolved_dtype())
    if asked_varlen:
        if reason and torch.cuda.is_available():
            raise ValueError(f"learner.attn_implementation varlen: {reason}")
        hf_config._attn_implementation = "varlen"  # as the model will load
        check_packable(hf_config)
    if config.pack_sequences != "auto":
        return
    if reason is None and not asked_varlen and config.attn_implementation is not None:
        reason = f"learner.attn_implementation {config.attn_implementation}"
    elif reason is None and has_sliding_window(hf_config):
        reason = "the model has sliding-window layers"
    config.pack_sequences = reason is None
    if config.pack_sequences:
        config.attn_implementation = "varlen"
        log.info("learner.pack_sequences auto: packed rows under varlen attention")
    else:
        log.info("learner.pack_sequences auto: padded rows (%s)", reason)


def prompts_shared(config: LearnerConfig) -> bool:
    """Whether micro-batches hold each prompt once (``learner.share_prompts``), once packing is settled."""
    packed_varlen = config.pack_sequences is True and config.attn_implementation == "varlen"
    if config.share_prompts is True and not packed_varlen:
        raise ValueError(
            "learner.share_prompts: true needs packed rows under varlen attention (learner.pack_sequences: true "
            f"and learner.attn_implementation: varlen; they are {config.pack_sequences} and "
            f"{config.attn_implementation})"
        )
    if config.share_prompts is False or not packed_varlen:
        return False
    from learners.attention import shared_spans_unavailable

    reason = shared_spans_unavailable()
    if reason and config.share_prompts is True:
        raise ValueError(f"learner.share_prompts: {reason}")
    if reason:
        log.warning("learner.share_prompts auto: each rollout's prompt in full (%s)", reason)
    return reason is None


def use_liger(config: LearnerConfig, model_type: str) -> bool:
    """Whether the model classes get Liger's kernels (``learner.liger_kernels``), which need liger-kernel and a GPU.

    ``auto`` turns them on only where all they need is there and where they
    have been run: not yet under ZeRO-3's partitioning (``true`` turns them on
    there). ``true`` makes a missing piece an error.
    """
    if config.liger_kernels is False:
        return False
    if config.liger_kernels == "auto":
        if config.compile:  # the compiler fuses the same operations in the compiled layers
            return False
        if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
            return False
        if zero_stage(config) == 3:
            return False
        try:
            return model_type in _liger_patches()
        except ImportError as exc:  # installed but not importable (say, against another transformers)
            log.warning("learner.liger_kernels: auto: liger_kernel does not import (%s); running without it", exc)
            return False
    from asyncrl.extras import require

    require("liger_kernel", "learner.liger_kernels: true")
    if not torch.cuda.is_available():
        raise ValueError("learner.liger_kernels: true needs a CUDA GPU (Liger's kernels are Triton); set it to false")
    return True


def _liger_patches() -> dict:
    """Liger's patch function for each model type it has kernels for."""
    from liger_kernel.transformers import monkey_patch

    return monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN


def apply_liger(model: torch.nn.Module) -> None:
    """Swap the model's RMSNorm, SwiGLU MLP and rotary embedding for Liger's fused Triton kernels.

    Liger patches transformers' module for the model type, so a reference model
    or critic of the same type built afterwards in this process gets them too.

    The loss stays asyncrl's chunked log-prob (``learners.loss``), which already
    never holds the full logits, so Liger's fused cross-entropy is not used.
    A model type Liger has no kernels for is refused (Liger itself would only log it).
    """
    model_type = model.config.model_type
    patches = _liger_patches()
    patch = patches.get(model_type)
    if patch is None:
        raise ValueError(
            f"learner.liger_kernels: Liger has no kernels for model type {model_type!r} "
            f"(it has: {', '.join(sorted(patches))}); set it to false"
        )
    wanted = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    accepted = inspect.signature(patch).parameters  # each model type's patch takes its own subset
    patch(model=model, **{key: value for key, value in wanted.items() if key in accepted})
