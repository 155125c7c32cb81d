import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from asyncrl.weights import folders
from asyncrl.weights.transports import folder_of

MODEL = ROOT / "assets/tiny-llama"


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL)


def test_published_version_loads_with_from_pretrained(model, tmp_path):
    state = {k: v + 1 for k, v in model.state_dict().items()}
    update = folders.publish(
        state.items(), version=3, weights_dir=tmp_path, model_dir=MODEL, config_json=model.config.to_json_string()
    )
    assert update.version == 3 and update.uri.endswith("v000003") and update.num_bytes > 0
    loaded = AutoModelForCausalLM.from_pretrained(folder_of(update))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    assert not list(tmp_path.glob("*.tmp"))


def test_old_versions_are_pruned(model, tmp_path):
    for v in range(1, 6):
        folders.publish(
            model.state_dict().items(),
            version=v,
            weights_dir=tmp_path,
            model_dir=MODEL,
            config_json=model.config.to_json_string(),
            keep_versions=2,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000004", "v000005"]


def test_load_is_all_or_nothing(model, tmp_path):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: v + 1 for k, v in before.items()}
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wrong shape.*lm_head"):
        folders.load_into(model, bad, version=9)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_missing_version_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="v4"):
        folders.read_state_dict(tmp_path / "v000004", 4)


def test_a_resumed_learner_discards_versions_of_the_undone_timeline(model, tmp_path):
    for v in range(1, 6):
        folders.publish(
            model.state_dict().items(),
            version=v,
            weights_dir=tmp_path,
            model_dir=MODEL,
            config_json=model.config.to_json_string(),
            keep_versions=10,
        )
    folders.discard_after(tmp_path, 3)
    folders.publish(
        model.state_dict().items(),
        version=3,
        weights_dir=tmp_path,
        model_dir=MODEL,
        config_json=model.config.to_json_string(),
        keep_versions=2,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]


def test_a_version_carries_the_tokenizer_files_of_a_model_without_tokenizer_json(tmp_path):
    # A SentencePiece model, or a BPE one with only its vocabulary and merges: the version folder, which
    # generators load and `asyncrl eval` reads, must tokenize as the model folder does.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    files = {"tokenizer.model": b"spm", "vocab.json": b"{}", "merges.txt": b"#", "tokenizer_config.json": b"{}"}
    for name, data in files.items():
        (model_dir / name).write_bytes(data)
    folder = folder_of(
        folders.publish(
            [("w", torch.zeros(2))], version=1, weights_dir=tmp_path / "w", model_dir=model_dir, config_json="{}"
        )
    )
    assert {name: (folder / name).read_bytes() for name in files} == files
