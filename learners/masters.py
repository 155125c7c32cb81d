"""The optimizer's fp32 master weights of a 16-bit learner: read one, set one, start them from the checkpoint.

DeepSpeed keeps them in different places: in flat fragments its own helpers reach (ZeRO-1/2/3 and its bf16
optimizer, a single bf16 rank's default), or per tensor in its 16-bit optimizer without ZeRO.
"""

from __future__ import annotations

import json
import logging
import os

import torch

log = logging.getLogger(__name__)


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files of an HF folder (one file, or the shards its index names)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.exists(single) else []


def _lone_masters(engine) -> dict[int, torch.Tensor]:
    """The fp32 copies in DeepSpeed's per-tensor 16-bit optimizer (no ZeRO), by ``id`` of their parameter."""
    optimizer = engine.optimizer
    return {
        id(lp): hp
        for low, high in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ()))
        for lp, hp in zip(low, high)
        if isinstance(hp, torch.Tensor) and hp.shape == lp.shape
    }


def _mapped(param: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed's own helpers reach ``param``'s master copy.

    They do for ZeRO-3 partitions, ZeRO-1/2 and bf16 fragments."""
    return hasattr(param, "ds_id") or getattr(param, "_hp_mapping", None) is not None


def master_weight(engine, param: torch.nn.Parameter) -> torch.Tensor | None:
    """A full copy of the optimizer's fp32 master weight of ``param``; None where it keeps none (fp32 training)."""
    from deepspeed.utils import safe_get_full_fp32_param

    if _mapped(param):
        return safe_get_full_fp32_param(param)
    lone = _lone_masters(engine).get(id(param))
    return lone.detach().clone() if lone is not None else None


def set_master_weights(engine, params: dict[str, torch.nn.Parameter], path: str) -> int:
    """Start the optimizer's fp32 master weights from the checkpoint's fp32 tensors, not from their 16-bit rounding.

    A bf16 model is loaded rounded, and DeepSpeed builds the fp32 master copy
    from those rounded weights: every weight then starts on the bf16 grid, and
    no update changes the policy until it has moved a weight half a grid step
    (about 1.2e-4 for a weight of 0.05, four Adam steps at lr 3e-5). From the
    checkpoint's own fp32 values, the rounding of the bf16 copy follows the
    master weights from the first step, as autocast training does. Checkpoints
    stored in 16 bits have nothing finer to give. ``params`` are the engine's
    parameters by their names in the checkpoint. Every rank must call this
    (ZeRO-3 sets each rank's partition); returns the number of weights set.
    """
    from safetensors import safe_open

    lone = _lone_masters(engine)
    done = 0
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                param = params.get(name)
                if param is None or f.get_slice(name).get_dtype() != "F32":
                    continue
                value = f.get_tensor(name)
                if value.numel() != (getattr(param, "ds_numel", None) or param.numel()):
                    continue
                done += set_master_weight(engine, param, value, lone)
    if done:
        log.info("fp32 master weights set from the checkpoint for %d of %d parameters", done, len(params))
    return done


def set_master_weight(engine, param: torch.nn.Parameter, value: torch.Tensor, lone: dict | None = None) -> bool:
    """Set ``param``'s fp32 master weight to ``value`` (``lone``: :func:`_lone_masters`, if already at hand);
    False where the optimizer keeps none."""
    from deepspeed.utils import safe_set_full_fp32_param

    if _mapped(param):
        safe_set_full_fp32_param(param, value)
        return True
    master = (_lone_masters(engine) if lone is None else lone).get(id(param))
    if master is None:
        return False
    with torch.no_grad():
        master.copy_(value.view_as(param))
    return True
