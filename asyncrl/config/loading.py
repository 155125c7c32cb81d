"""Reading a run config: a YAML file plus dotted command-line overrides, validated into a RunConfig.

An error names the file or the override and the dotted key; a renamed key, or
a peer framework's name for a setting (TRL, verl, OpenRLHF), gets the key meant.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import yaml

from asyncrl.config.describe import _is_struct
from asyncrl.config.run import RunConfig
from asyncrl.config.sections import ConfigError

log = logging.getLogger(__name__)


def _pairs(overrides: list[str]) -> list[tuple[str, str]]:
    """``(dotted key, value text)`` of ``key.sub=value`` / ``--key.sub value`` overrides."""
    pairs: list[tuple[str, str]] = []
    items = list(overrides)
    while items:
        item = items.pop(0)
        key = item[2:] if item.startswith("--") else item
        if "=" in key:
            key, value = key.split("=", 1)
        elif items and not items[0].startswith("--"):
            value = items.pop(0)
        else:
            raise ConfigError(f"override --{key} has no value (write --{key}=VALUE)")
        pairs.append((key, value))
    return pairs


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` / ``--key.sub value`` overrides to a raw config dict.

    Values are parsed as YAML scalars (``1e-5``, ``true``, ``[a, b]``), except
    for text settings, which take the value as written: ``"#### <number>"``
    would be a YAML comment, ``yes`` a boolean, ``0123`` a number (a value in
    YAML quotes is still read as YAML). ``null`` unsets a text setting that
    may be unset.
    """
    for key, value in _pairs(overrides):
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: `{part}` is not a section")
            node = child
        text = _text_key(key)
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""  # YAML's quotes, as ever
        if text is None or quoted:
            node[leaf] = yaml.safe_load(value)
        else:
            node[leaf] = None if text == "optional" and value in ("null", "~") else value
    return data


def _key_type(parts: Sequence[str]) -> Any:
    """The type of the setting (or section) at dotted path ``parts`` of :class:`RunConfig`; None if none."""
    cls: Any = RunConfig
    for part in parts:
        cls = {f.name: f.type for f in msgspec.structs.fields(cls)}.get(part) if _is_struct(cls) else None
    return cls


def _text_key(key: str) -> str | None:
    """``"text"`` if ``key`` is a plain text setting, ``"optional"`` if text or null, None otherwise."""
    cls = _key_type(key.split("."))
    if cls is str:
        return "text"
    if get_origin(cls) in (Union, types.UnionType) and set(get_args(cls)) == {str, type(None)}:
        return "optional"
    return None


# Keys that were renamed or moved, and what they are now: an old config gets one line, not "unknown field".
RENAMED = {
    "learner.clip_eps": "`algo.clip_eps`",
    "learner.kl_coef": "`algo.kl_coef`",
    "ray.stop_timeout_s": "`learner.stop_timeout_s` (asyncrl run waits that long too, with or without Ray)",
}

# What TRL's GRPOConfig, verl and OpenRLHF call a setting, and the key here (then a note), for the "unknown key"
# error.
_PROMPTS_PER_STEP = "learner.groups_per_step (prompts per step; samples = groups x generator.samples_per_prompt)"
PEER_NAMES = {
    "learning_rate": "learner.lr",
    "actor_learning_rate": "learner.lr",
    "lr": "learner.lr",
    "num_generations": "generator.samples_per_prompt",
    "n_samples_per_prompt": "generator.samples_per_prompt",
    "rollout_n": "generator.samples_per_prompt",
    "batch_size": _PROMPTS_PER_STEP,
    "train_batch_size": _PROMPTS_PER_STEP,
    "per_device_train_batch_size": _PROMPTS_PER_STEP,
    "rollout_batch_size": "learner.groups_per_step (prompts per step)",
    "max_completion_length": "generator.max_new_tokens",
    "response_length": "generator.max_new_tokens",
    "max_response_length": "generator.max_new_tokens",
    "generate_max_len": "generator.max_new_tokens",
    "max_prompt_length": "task.max_prompt_tokens",
    "prompt_max_len": "task.max_prompt_tokens",
    "beta": "algo.kl_coef",
    "kl_loss_coef": "algo.kl_coef",
    "init_kl_coef": "algo.kl_coef",
    "epsilon": "algo.clip_eps",
    "clip_ratio": "algo.clip_eps",
    "eps_clip": "algo.clip_eps",
    "epsilon_high": "algo.clip_eps_high",
    "clip_ratio_high": "algo.clip_eps_high",
    "delta": "algo.dual_clip",
    "clip_ratio_c": "algo.dual_clip",
    "max_steps": "learner.total_steps",
    "total_training_steps": "learner.total_steps",
    "num_train_epochs": "learner.total_steps (steps, not epochs)",
    "max_grad_norm": "learner.grad_clip",
    "grad_clip": "learner.grad_clip",
    "gradient_checkpointing": "learner.gradient_checkpointing",
    "model_name_or_path": "model.path",
    "pretrain": "model.path",
    "vllm_gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    "gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    "entropy_coeff": "algo.entropy_coef",
    "loss_agg_mode": "algo.loss_agg",
    "loss_type": "algo.loss_agg",
    "adv_estimator": "algo.advantage",
    "advantage_estimator": "algo.advantage",
    "scale_rewards": "algo.reward_scaling",
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"`{key}` is given twice in one section", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply dotted overrides, and validate it.

    Raises :class:`ConfigError` naming the file (or the override) and the offending key.
    """
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path:
        try:
            data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            inside = Path(path) / "config.yaml"
            hint = f" (this run folder's config is {inside})" if inside.exists() else ""
            raise ConfigError(f"{path} is a folder, not a config file{hint}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    if overrides:
        data = apply_overrides(data, overrides)
    for old, new in RENAMED.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(f"{source}: `{old}` is now {new}")
    _translate_bucket_mb(data, source)
    try:
        return msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explained(exc, source, overrides or [])) from None


def _explained(error: msgspec.ValidationError, source: str, overrides: list[str]) -> str:
    """A validation error that blames the override that set the key, if one did, and suggests the key meant
    where one is unknown."""
    text = str(error)
    where = re.search(r" - at `\$((?:\.\w+)*)`", text)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
    parts = [p for p in (where.group(1).split(".") if where else []) if p]
    key = ".".join(parts + ([unknown.group(1)] if unknown else []))
    set_by = [
        k for k, _ in _pairs(overrides) if key and (k == key or key.startswith(k + ".") or k.startswith(key + "."))
    ]
    blamed = f"override --{set_by[-1]}" if set_by else source
    cls = _key_type(parts)
    if unknown:
        known = [f.name for f in msgspec.structs.fields(cls)] if _is_struct(cls) else []
        close = difflib.get_close_matches(unknown.group(1), known, n=1)
        section = ".".join(parts)
        if unknown.group(1) in PEER_NAMES:
            meant, _, note = PEER_NAMES[unknown.group(1)].partition(" ")
            hint = f"; that setting is `{meant}` here{' ' + note if note else ''}"
        else:
            hint = f"; did you mean `{section + '.' if section else ''}{close[0]}`?" if close else ""
        return f"{blamed}: unknown key `{key}`{hint}"
    if text.startswith("Invalid enum value") and get_origin(cls) is Literal:
        return f"{blamed}: {text} (expected one of {', '.join(map(str, get_args(cls)))})"
    return f"{blamed}: {text}"


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML, as written next to a run's outputs."""
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


def _translate_bucket_mb(data: dict[str, Any], source: str) -> None:
    """``learner.zero_bucket_mb: N`` (every run folder's config.yaml from before the key was renamed holds it)
    read as ``learner.zero_bucket_elements: N * 2**20``, the elements it always meant to DeepSpeed."""
    learner = data.get("learner")
    if not isinstance(learner, dict) or "zero_bucket_mb" not in learner:
        return
    value = learner.pop("zero_bucket_mb")
    if "zero_bucket_elements" in learner:
        raise ConfigError(
            f"{source}: `learner.zero_bucket_mb` and `learner.zero_bucket_elements` both set; "
            "keep zero_bucket_elements (DeepSpeed counts its buckets in elements)"
        )
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(
            f"{source}: `learner.zero_bucket_mb` is now `learner.zero_bucket_elements`, "
            "in elements as DeepSpeed counts them"
        )
    learner["zero_bucket_elements"] = value * 2**20
    log.warning(
        "%s: learner.zero_bucket_mb: %d read as learner.zero_bucket_elements: %d (the key was renamed: "
        "DeepSpeed counts its buckets in elements)",
        source,
        value,
        value * 2**20,
    )
