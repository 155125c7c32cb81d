"""Typed configuration: one section per process, one run config over them.

A run is described by one YAML file (``configs/*.yaml``). Every process reads
the same file and uses its own section: ``asyncrl-generator`` reads
``generator``, ``asyncrl-learner`` reads ``learner``, and both read the
shared ``model``, ``task``, ``buffer``, ``coordinator`` and ``staleness``
sections. :class:`RunConfig` checks the invariants that span processes.

Values are validated by msgspec; an error names the file and the dotted key.
Command-line overrides use the same dotted keys: ``--learner.lr 1e-5``.

The package's modules, one job each: :mod:`~asyncrl.config.sections`,
:mod:`~asyncrl.config.learning` and :mod:`~asyncrl.config.deployment` (one
Struct per process or shared concern), :mod:`~asyncrl.config.run`
(:class:`RunConfig` and the cross-process checks),
:mod:`~asyncrl.config.loading` (YAML and overrides),
:mod:`~asyncrl.config.describe` (the keys' ``--help`` text),
:mod:`~asyncrl.config.secrets` (secret files) and
:mod:`~asyncrl.config.argtypes` (argparse types). Import the names from
``asyncrl.config``: the modules are its layout, not its interface.
"""

from asyncrl.config.argtypes import finite_number, on_or_off, positive_seconds
from asyncrl.config.deployment import (
    BufferConfig,
    CoordinatorConfig,
    MpsConfig,
    PrometheusConfig,
    PushConfig,
    RayConfig,
)
from asyncrl.config.describe import describe_keys
from asyncrl.config.learning import TOKEN_REWARD_ESTIMATORS, AlgoConfig, LearnerConfig, LoraConfig
from asyncrl.config.loading import PEER_NAMES, RENAMED, apply_overrides, load_config, to_yaml
from asyncrl.config.run import RunConfig
from asyncrl.config.secrets import check_secrets, read_secret, read_secret_file
from asyncrl.config.sections import (
    DIGIT_PROMPTS,
    DIGIT_REWARD,
    ConfigError,
    EpisodeConfig,
    EvalConfig,
    GeneratorConfig,
    ModelConfig,
    RemoteRewardConfig,
    StalenessConfig,
    TaskConfig,
    VllmConfig,
)
from asyncrl.config.shared_engine import check_one_engine, check_shared_engine

__all__ = [
    "check_one_engine",
    "check_shared_engine",
    "DIGIT_PROMPTS",
    "DIGIT_REWARD",
    "PEER_NAMES",
    "RENAMED",
    "TOKEN_REWARD_ESTIMATORS",
    "AlgoConfig",
    "BufferConfig",
    "ConfigError",
    "CoordinatorConfig",
    "EpisodeConfig",
    "EvalConfig",
    "GeneratorConfig",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "MpsConfig",
    "PrometheusConfig",
    "PushConfig",
    "RayConfig",
    "RemoteRewardConfig",
    "RunConfig",
    "StalenessConfig",
    "TaskConfig",
    "VllmConfig",
    "apply_overrides",
    "check_secrets",
    "describe_keys",
    "finite_number",
    "load_config",
    "on_or_off",
    "positive_seconds",
    "read_secret",
    "read_secret_file",
    "to_yaml",
]
