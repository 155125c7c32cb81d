"""The policy's decoder layers under torch.compile: ``learner.compile``.

A small model's step is bound by the host: on one H100 a SmolLM2-135M step
launched 2,900 kernels and kept the GPU busy 36% of the time, Liger's Triton
kernels costing 130-180 µs of Python each (bench/README.md). Compiling each
decoder layer (regional compilation, as transformers and accelerate do it)
fuses its norms, rotary embedding, activations and residuals into a few
kernels, forward and backward alike. Every layer runs the same code, so one
graph serves them all, and with dynamic shapes one graph serves every
micro-batch's length: a run compiles once, not once per batch.

The compiling is done before the first batch (:func:`warm_up`), on a small
batch of made-up rollouts laid out as the step lays out its own, while the
generators sample the first real one. The log-prob head, the loss and the
optimizer stay as they are (they already run as a few large kernels).
"""

from __future__ import annotations

import logging
import time

import torch

from asyncrl.wire.protocol import Rollout
from learners.models import world_size
from learners.packing import pack

log = logging.getLogger(__name__)


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place (dynamic shapes); returns how many there are."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"learner.compile: {type(model).__name__} keeps no list of decoder layers at get_decoder().layers "
            "to compile one by one; set it to false"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def warm_up(engine, layout: dict[str, bool], temperature: float, vocab_size: int, seed: int = 0) -> float | None:
    """Compile the layers' forward and backward now, on made-up rollouts; the seconds it took, or None where it
    is left to the first step.

    The forward and backward go straight through the engine's module, around DeepSpeed, and the gradients
    they leave (of a loss multiplied by 0) are dropped: the optimizer, its state and the step counts are as
    they were. That holds where DeepSpeed hooks nothing into the backward: one rank at ZeRO stage 0 or 1. On
    several ranks, or at stage 2, whose hooks reduce gradients as they come, the first step compiles.
    """
    if engine.zero_optimization_stage() > 1 or world_size() > 1:
        log.info("learner.compile: the layers compile in the first step (ZeRO stage 2, or several ranks)")
        return None
    started = time.monotonic()
    generator = torch.Generator().manual_seed(seed)
    module = engine.module
    batch = pack(_rollouts(vocab_size, generator), advantages=[1.0, -1.0, 1.0, -1.0], **layout).to(engine.device)
    module.train()
    logprobs, _ = module(
        batch.ids, batch.attention_mask, batch.targets, temperature, batch.position_ids, **batch.logprob_options()
    )
    (logprobs.sum() * 0.0).backward()
    module.zero_grad(set_to_none=True)
    seconds = time.monotonic() - started
    log.info("learner.compile: the layers compiled in %.1f s, before the first batch", seconds)
    return seconds


def _rollouts(vocab_size: int, generator: torch.Generator) -> list[Rollout]:
    """Two groups of two: answers of different lengths, so padded rows hold padding and packed rows several
    spans, as a real micro-batch does."""

    def ids(count: int) -> list[int]:
        return torch.randint(1, vocab_size, (count,), generator=generator).tolist()

    rollouts = []
    for group in range(2):
        prompt = ids(6 + group)
        for sample, length in enumerate((3, 5)):
            rollouts.append(
                Rollout(
                    rollout_id=f"warm-up-{group}-{sample}",
                    group_id=f"warm-up-{group}",
                    group_size=2,
                    prompt_index=group,
                    prompt_ids=prompt,
                    response_ids=ids(length),
                    logprobs=[-1.0] * length,
                    versions=[0] * length,
                    reward=float(sample),
                    finish_reason="length",
                    generator_id="warm-up",
                    created_s=0.0,
                )
            )
    return rollouts
