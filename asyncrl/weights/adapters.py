"""LoRA adapters as weight versions: what the learner sends and generators load when ``learner.lora`` is on.

The learner trains a peft adapter on the frozen base; each version is the
adapter alone, its tensors named as peft saves them
(``base_model.model.<module>.lora_A.weight``), so a published folder is a
PEFT adapter folder (``adapter_model.safetensors`` and
``adapter_config.json``) that peft and vLLM load as it is. Generators start
from the same base with a fresh adapter (its ``lora_B`` is zero, so version 0
samples as the base does) and copy each version's adapter in place.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.weights.folders import ADAPTER_CONFIG, ADAPTER_FILE, check_shapes, write_adapter_folder

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from asyncrl.config import LoraConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "AdapterView", "check_lora", "load_adapter", "published", "with_adapter"]

ADAPTER = "default"  # peft's name for a model's one adapter


def peft_config(lora: LoraConfig) -> Any:
    """peft's ``LoraConfig`` for ``learner.lora``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def with_adapter(model: torch.nn.Module, lora: LoraConfig, disable_dropout: bool = False) -> PeftModel:
    """``model`` with a fresh adapter in its target modules (the base frozen); an error naming
    ``learner.lora.target_modules`` when they match nothing. ``disable_dropout`` (``learner.disable_dropout``):
    the adapter's dropout is 0 whatever ``lora.dropout`` says, as the generators sample with none."""
    from peft import get_peft_model

    if disable_dropout and lora.dropout > 0:
        log.info("learner.disable_dropout: learner.lora.dropout %g set to 0", lora.dropout)
        lora = msgspec.structs.replace(lora, dropout=0.0)
    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as exc:
        raise ValueError(f"learner.lora.target_modules: {lora.target_modules!r}: {exc}") from exc


def saved_name(name: str) -> str:
    """The name peft saves a parameter of the adapter under: its own name less the adapter's.

    ``...lora_A.default.weight`` in the model is ``...lora_A.weight`` in a PEFT folder.
    """
    return name.replace(f".{ADAPTER}", "")


def adapter_config_json(peft_model: PeftModel) -> str:
    """``adapter_config.json`` of the model's adapter, as peft writes it."""
    config = peft_model.peft_config[ADAPTER].to_dict()
    return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}, indent=2, default=str)


class AdapterView:
    """A peft model's adapter as the model a weight sender publishes: only its trainable tensors, named as
    peft saves them, beside the base's ``config``.

    Senders read ``named_parameters``, ``parameters`` and ``config`` (and a folder
    writer ``adapter_config_json``); the parameters are the model's own, so
    ZeRO-3's gather works on them as on any other.
    """

    def __init__(self, peft_model: PeftModel) -> None:
        self.config = peft_model.config
        self.adapter_config_json = adapter_config_json(peft_model)
        trained = [(name, param) for name, param in peft_model.named_parameters() if param.requires_grad]
        self._named = [(saved_name(name), param) for name, param in trained]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return iter(self._named)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (param for _, param in self._named)


def published(model: torch.nn.Module) -> Any:
    """What a version of ``model`` is: its adapter for a peft model, else the whole model."""
    from peft import PeftModel

    return AdapterView(model) if isinstance(model, PeftModel) else model


def load_adapter(peft_model: PeftModel, state: Mapping[str, torch.Tensor], version: int) -> None:
    """Copy an adapter version into ``peft_model``, all or nothing: every name and shape is checked first."""
    import torch
    from peft import set_peft_model_state_dict

    check_shapes(adapter_shapes(peft_model), {name: tuple(tensor.shape) for name, tensor in state.items()}, version)
    with torch.no_grad():
        set_peft_model_state_dict(peft_model, dict(state))


# The adapter ranks vLLM's engine can be sized for (its max_lora_rank choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds an adapter of ``rank``."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        largest = VLLM_LORA_RANKS[-1]
        raise ValueError(f"learner.lora.rank: {rank} is above the largest adapter rank vLLM serves ({largest})")
    return fitting[0]


def check_lora(lora: LoraConfig, backend: str, model_dir: str | None) -> None:
    """Before any process starts: the adapter fits the generators' engine and its target modules are in the
    model (``model_dir``'s config, built without weights). Every weight transport carries adapters."""
    if lora.rank < 0:
        raise ValueError(f"learner.lora.rank: {lora.rank}; 0 turns LoRA off, a positive rank turns it on")
    if not lora.enabled:
        return
    if backend == "vllm":
        vllm_max_lora_rank(lora.rank)
    if model_dir is not None:
        meta_adapter(lora, model_dir)


def without_weights(model_dir: str | Path) -> torch.nn.Module:
    """``model_dir``'s model built from its config alone, on the meta device: its modules, no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a LoRA learner's saved base model (``model.layers...lora_A.default.weight``),
    named as peft saves them."""
    return {f"base_model.model.{saved_name(name)}": t for name, t in state.items() if ".lora_" in name}


def meta_adapter(lora: LoraConfig, model_dir: str) -> PeftModel:
    """The adapter ``learner.lora`` puts on ``model_dir``'s model, built without weights.

    Its config names ``model_dir`` as the base, so a folder written from it says which model it goes on.
    """
    peft_model = with_adapter(without_weights(model_dir), lora)
    peft_model.peft_config[ADAPTER].base_model_name_or_path = str(model_dir)
    return peft_model


def adapter_config_for(lora: LoraConfig, model_dir: str) -> str:
    """``adapter_config.json`` of the adapter ``learner.lora`` puts on ``model_dir``'s model."""
    return adapter_config_json(meta_adapter(lora, model_dir))


def merge(model_dir: str, adapter_dir: str | Path) -> torch.nn.Module:
    """The base at ``model_dir`` with the PEFT adapter at ``adapter_dir`` merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def adapter_shapes(peft_model: PeftModel) -> dict[str, tuple[int, ...]]:
    """Names and shapes of what a version of ``peft_model``'s adapter holds (:class:`AdapterView`'s tensors)."""
    return {name: tuple(param.shape) for name, param in AdapterView(peft_model).named_parameters()}


def write_zero_adapter(peft_model: PeftModel, folder: Path) -> Path:
    """A PEFT folder of ``peft_model``'s adapter with every tensor zero: version 0 for an engine that serves adapters.

    It gives the base's own outputs. Only the model's names, shapes and config are read, so a
    :func:`meta_adapter` serves.
    """
    import torch

    zeros = ((name, torch.zeros(shape)) for name, shape in adapter_shapes(peft_model).items())
    write_adapter_folder(zeros, folder, adapter_config_json(peft_model))
    return folder
