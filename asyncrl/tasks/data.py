"""Prompt datasets: files, ``save_to_disk`` folders and cached hub datasets, read with the ``datasets`` library.

``task.dataset`` names the source:

* a ``.jsonl`` / ``.json`` file: read line by line (streamed, so a large file
  is never copied into an Arrow cache) and parsed row by row, so one
  malformed line is reported with its line number and skipped instead of
  failing the whole file;
* a ``.parquet`` file (streamed);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* anything else: a hub dataset name, read from the local ``datasets`` cache
  (``task.split``); nothing is downloaded.

Suffixes are matched in any case, and a JSON file may be gzipped
(``.jsonl.gz``). ``task.eval_dataset`` is read the same way, from
``task.eval_split``.

Every source yields rows; each becomes an item ``{"prompt": str, "label": ...,
"row": N, **row}`` (the prompt may also be a conversation, a list of
``{"role", "content"}`` messages, as TRL's and verl's datasets hold it) or is
skipped with a reason (``missing_input``, ``input_not_text`` (neither text
nor such a conversation), ``missing_label`` (none, empty, or a GSM8K ``####``
with nothing after it), ``label_not_scalar`` (a list or an object: not
guessed at), ``malformed_json``, ``not_utf8``, ``prompt_too_long``) that is
logged with its row number and counted. The
learner and every generator load the same source the same way, so item
``i`` is the same prompt everywhere.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import TaskConfig

log = logging.getLogger(__name__)

_LOGGED_PER_REASON = 5


@dataclass
class TaskData:
    """The training prompts, the held-out ones, and what was skipped on the way."""

    items: list[dict[str, Any]]
    eval_items: list[dict[str, Any]]
    skipped: Counter[str] = field(default_factory=Counter)


def _rows(source: str, split: str, field_name: str = "task.dataset") -> Iterator[tuple[int, dict[str, Any] | str]]:
    """``(row number, row)`` from a source; a row that is not a JSON object comes back as its error.

    ``split`` is read from hub datasets and DatasetDict folders (``task.split``, or ``task.eval_split`` for
    ``task.eval_dataset``).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a cached dataset or a local file: never the network
    import datasets

    path = Path(source)
    suffix = _suffix(path)
    if path.is_file() and suffix == ".json" and _starts_with(path, "["):  # one JSON array, not JSON lines
        try:
            with _open(path) as file:
                rows = json.loads(file.read().decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{field_name}: {source} is not valid JSON: {error}") from None
        for number, row in enumerate(rows, start=1):
            yield number, row if isinstance(row, dict) else f"malformed_json: a {type(row).__name__}, not an object"
        return
    if path.is_file() and suffix in (".jsonl", ".json"):
        yield from _json_lines(path)
        return
    split_key = "task.eval_split" if field_name == "task.eval_dataset" else "task.split"
    if path.is_file() and suffix == ".parquet":
        table = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
    elif path.is_dir():
        if not any((path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
            files = sorted(p.name for p in path.iterdir() if _suffix(p) in (".jsonl", ".json", ".parquet"))[:6]
            raise ValueError(
                f"{field_name}: {source} is a folder, but not one `save_to_disk` wrote"
                + (
                    f"; name a file in it: {', '.join(str(path / f) for f in files)}"
                    if files
                    else " (it holds no .jsonl, .json or .parquet file either)"
                )
            )
        table = datasets.load_from_disk(str(path))
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise ValueError(f"{field_name}: {source} has splits {sorted(table)}, not {split_key}={split!r}")
            table = table[split]
    elif suffix in (".jsonl", ".json", ".parquet"):
        raise FileNotFoundError(f"{field_name}: {source} does not exist")
    else:
        try:
            table = datasets.load_dataset(source, split=split)
        except Exception as error:  # noqa: BLE001  (datasets raises many kinds; the user needs one line)
            raise ValueError(
                f"{field_name}: {source!r} is neither a file, a save_to_disk folder nor a dataset "
                f"in the local cache ({split_key}={split!r}; {type(error).__name__}: {error})"
            ) from error
    yield from enumerate(table, start=1)


def _suffix(path: Path) -> str:
    """The format suffix, in lower case (``DATA.JSONL``), looking past a ``.gz``."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    return suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) == 2 else (suffixes[-1] if suffixes else "")


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else path.open("rb")


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Rows of a JSON lines file, read as bytes and split at newlines only (a U+2028 inside a string is
    text, not a line break); a line that is not UTF-8 is a skipped row like a malformed one."""
    with _open(path) as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()  # an editor's BOM on line 1
            except UnicodeDecodeError as error:
                yield number, f"not_utf8: {error}"
                continue
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                yield number, f"malformed_json: {error}"
                continue
            yield number, row if isinstance(row, dict) else f"malformed_json: a {type(row).__name__}, not an object"


def _starts_with(path: Path, char: str) -> bool:
    with _open(path) as file:
        while block := file.read(4096):
            if stripped := block.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n"):
                return stripped[0] == char
    return False


def check_rows(source: str, task: TaskConfig, field_name: str, rows: int = 100) -> dict[str, Any]:
    """The first usable item of ``source`` among its first ``rows`` rows, else an error naming ``field_name``,
    the reasons and the keys looked for."""
    skipped: Counter[str] = Counter()
    for number, row in _rows(source, _split(task, field_name), field_name):
        item, reason = (None, row.split(":", 1)[0]) if isinstance(row, str) else _item(row, number, task)
        if item is not None:
            return item
        skipped[reason] += 1
        if number >= rows:
            break
    raise ValueError(
        f"{field_name}: none of the first {sum(skipped.values())} rows of {source} is usable "
        f"(skipped: {dict(skipped)}; task.input_key={task.input_key!r}, "
        f"task.label_key={task.label_key!r})"
    )


def _field(row: dict[str, Any], key: str) -> Any:
    """``row[key]``; a dotted key reads nested columns (verl's ``reward_model.ground_truth``), unless the row
    has a column of that very name."""
    if key in row or "." not in key:
        return row.get(key)
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _is_conversation(messages: list[Any]) -> bool:
    """A prompt given as chat messages (TRL's conversational format, verl's ``prompt`` column): a non-empty list
    of ``{"role": str, "content": str}``, ending with a message to answer (not the assistant's own)."""
    return (
        bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        and messages[-1]["role"] != "assistant"
    )


def _item(row: dict[str, Any], number: int, task: TaskConfig) -> tuple[dict[str, Any] | None, str]:
    prompt = _field(row, task.input_key)
    if prompt is None:
        return None, "missing_input"
    if not (_is_conversation(prompt) if isinstance(prompt, list) else isinstance(prompt, str) and prompt.strip()):
        return None, "input_not_text"
    label = _field(row, task.label_key)
    if isinstance(label, str) and "####" in label:  # a GSM8K solution: the answer follows the last ####
        label = label.rsplit("####", 1)[1].strip()
    if label is None or (isinstance(label, str) and not label.strip()):  # an empty label scores every answer 0
        return None, "missing_label"
    if not isinstance(label, (str, int, float)):  # a list or dict: no reward reads it
        return None, "label_not_scalar"
    return {**row, "prompt": prompt, "label": label, "row": number}, ""


def _split(task: TaskConfig, field_name: str) -> str:
    return task.eval_split if field_name == "task.eval_dataset" else task.split


def load_task_data(task: TaskConfig, count_tokens: Callable[[dict[str, Any]], int] | None = None) -> TaskData:
    """Read ``task.dataset`` (and ``task.eval_dataset``), skipping and counting bad rows.

    ``count_tokens(item)`` gives the length of an item's built prompt; with
    ``task.max_prompt_tokens`` set, longer prompts are skipped.
    """
    data = TaskData(items=[], eval_items=[])
    data.items = _load(task.dataset, task, count_tokens, data.skipped, "task.dataset")
    if not data.items:
        raise ValueError(
            f"task.dataset: no usable rows in {task.dataset} (skipped: {dict(data.skipped)}; "
            f"task.input_key={task.input_key!r}, task.label_key={task.label_key!r})"
        )
    if task.eval_dataset:
        held_out, trained = Path(task.eval_dataset), Path(task.dataset)
        one_split = held_out.is_file() or not (held_out / "dataset_dict.json").exists()  # a save_to_disk Dataset
        if held_out.exists() and held_out.resolve() == trained.resolve() and one_split:
            raise ValueError(
                f"task.eval_dataset: {task.eval_dataset} is task.dataset's "
                f"{'file' if held_out.is_file() else 'folder, which holds one split'}: the held-out prompts "
                "would be the training prompts (use task.eval_fraction to hold some out)"
            )
        eval_skipped: Counter[str] = Counter()
        data.eval_items = _load(task.eval_dataset, task, count_tokens, eval_skipped, "task.eval_dataset")
        if not data.eval_items:
            raise ValueError(
                f"task.eval_dataset: no usable rows in {task.eval_dataset} (skipped: "
                f"{dict(eval_skipped)}; task.input_key={task.input_key!r}, "
                f"task.label_key={task.label_key!r})"
            )
        data.skipped.update({f"eval_{reason}": n for reason, n in eval_skipped.items()})
    elif task.eval_fraction > 0:
        order = list(range(len(data.items)))
        random.Random(task.seed).shuffle(order)
        # At least one: a fraction of a few rows that rounds to none would turn evaluation off without a word.
        count = max(1, round(task.eval_fraction * len(order)))
        if count >= len(order):
            raise ValueError(
                f"task.eval_fraction: {task.eval_fraction:g} of the {len(order)} usable rows of "
                f"{task.dataset} holds out {count}, leaving none to train on"
            )
        held = set(order[:count])
        data.eval_items = [item for i, item in enumerate(data.items) if i in held]
        data.items = [item for i, item in enumerate(data.items) if i not in held]
    if not data.items:
        raise ValueError(f"task.dataset: no usable rows in {task.dataset} left after task.eval_fraction")
    if data.skipped:
        log.warning("task.dataset: skipped %d rows: %s", sum(data.skipped.values()), dict(data.skipped))
    return data


def _load(source: str, task: TaskConfig, count_tokens, skipped: Counter[str], field_name: str) -> list[dict]:
    items = []
    for number, row in _rows(source, _split(task, field_name), field_name):
        if isinstance(row, str):
            reason, detail = row.split(":", 1)[0], row
        else:
            item, reason = _item(row, number, task)
            detail = f"{task.input_key!r} / {task.label_key!r}"
            if item is not None and task.max_prompt_tokens and count_tokens is not None:
                length = count_tokens(item)
                if length > task.max_prompt_tokens:
                    item, reason, detail = None, "prompt_too_long", f"{length} > {task.max_prompt_tokens} tokens"
            if item is not None:
                items.append(item)
                continue
        skipped[reason] += 1
        if skipped[reason] <= _LOGGED_PER_REASON:
            log.warning("%s: %s row %d skipped (%s): %s", field_name, source, number, reason, detail)
    return items
