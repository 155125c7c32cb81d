from pathlib import Path

import pytest

from asyncrl.config import ConfigError, RunConfig, load_config, to_yaml
from conftest import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)
    assert Path(ROOT / config.model.path).exists() or Path(config.model.path).exists()


def test_dotted_overrides_in_both_forms():
    config = load_config(ROOT / "configs/quickstart.yaml", ["--learner.lr", "1e-5", "generator.stop=[x, y]"])
    assert config.learner.lr == pytest.approx(1e-5)
    assert config.generator.stop == ["x", "y"]


def test_bad_value_names_key_and_file():
    with pytest.raises(ConfigError, match=r"quickstart.yaml.*\$\.learner\.lr"):
        load_config(ROOT / "configs/quickstart.yaml", ["--learner.lr", "fast"])


def test_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*lrr.*\$\.learner"):
        load_config(path)


def test_cross_process_invariants_are_checked():
    with pytest.raises(ConfigError, match=r"max_staleness"):
        load_config(None, ["--staleness.max_staleness", "-1"])
    with pytest.raises(ConfigError, match=r"coordinator.address"):
        load_config(None, ["--coordinator.address", "tcp://127.0.0.1:5555"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(ROOT / "configs/quickstart.yaml", ["--learner.total_steps", "7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config
