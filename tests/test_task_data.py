"""Datasets as users bring them: files, save_to_disk folders, bad rows skipped and counted by row number."""

import json
import logging
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from asyncrl.config import TaskConfig
from asyncrl.tasks import open_task, prompt_builder
from asyncrl.tasks.data import load_task_data

TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-llama")


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_bad_rows_are_skipped_counted_and_logged_with_their_line_numbers(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "1+1=", "answer": "Add them.\n#### 2"},  # line 1: a GSM8K solution
            {"answer": "3"},  # line 2: no question
            {"question": 7, "answer": "7"},  # line 3: not text
            "{not json",  # line 4
            {"question": "2+2=", "answer": None},  # line 5: no label
            {"question": "3+3=", "answer": 6},  # line 6
            "[1, 2]",  # line 7: not an object
        ],
    )
    task = TaskConfig(dataset=path, input_key="question", label_key="answer")
    with caplog.at_level(logging.WARNING):
        data = load_task_data(task)
    assert [(i["prompt"], i["label"], i["row"]) for i in data.items] == [("1+1=", "2", 1), ("3+3=", 6, 6)]
    assert data.skipped == {"missing_input": 1, "input_not_text": 1, "malformed_json": 2, "missing_label": 1}
    for line in (2, 3, 4, 5, 7):
        assert f"train.jsonl row {line} skipped" in caplog.text


def test_prompts_over_the_token_limit_are_skipped(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "12=", "answer": "1"}, {"prompt": "1234567890" * 3, "answer": "2"}]
    )
    task = TaskConfig(dataset=path, max_prompt_tokens=10)
    data = load_task_data(task, lambda item: len(TOKENIZER(item["prompt"]).input_ids))
    assert [i["prompt"] for i in data.items] == ["12="] and data.skipped == {"prompt_too_long": 1}


def short_and_long(n: int = 2) -> list[dict]:
    """A prompts hook: one short prompt and ``n - 1`` long ones."""
    return [{"prompt": "12="}] + [{"prompt": "1234567890" * 3}] * (n - 1)


def test_prompts_from_a_hook_over_the_token_limit_are_skipped_too():
    from asyncrl.tasks import load_items

    task = TaskConfig(prompts="test_task_data:short_and_long", prompt_args={"n": 3}, max_prompt_tokens=10)
    items, _, skipped = load_items(task, TOKENIZER)
    assert [i["prompt"] for i in items] == ["12="] and skipped == {"prompt_too_long": 2}
    tight = TaskConfig(prompts="test_task_data:short_and_long", max_prompt_tokens=1)
    with pytest.raises(ValueError, match=r"task\.prompts: all 2 prompts are longer than task\.max_prompt_tokens"):
        load_items(tight, TOKENIZER)


def test_parquet_and_save_to_disk_folders_load_like_jsonl(tmp_path):
    import datasets

    rows = {"prompt": ["a=", "b=", "c="], "answer": ["1", "2", "3"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "t.parquet"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows),
            "test": datasets.Dataset.from_dict({"prompt": ["z="], "answer": ["9"]}),
        }
    ).save_to_disk(str(tmp_path / "saved"))
    for source, split, prompts in (
        (tmp_path / "t.parquet", "train", ["a=", "b=", "c="]),
        (tmp_path / "saved", "test", ["z="]),
    ):
        data = load_task_data(TaskConfig(dataset=str(source), split=split))
        assert [i["prompt"] for i in data.items] == prompts
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\], not task.split='dev'"):
        load_task_data(TaskConfig(dataset=str(tmp_path / "saved"), split="dev"))


def test_a_save_to_disk_folder_of_one_split_is_refused_as_its_own_held_out_set(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"prompt": ["a=", "b="], "answer": ["1", "2"]}).save_to_disk(str(tmp_path / "one"))
    same = TaskConfig(dataset=str(tmp_path / "one"), eval_dataset=str(tmp_path / "one"))
    with pytest.raises(ValueError, match="task.eval_dataset: .* is task.dataset's folder, which holds one split"):
        load_task_data(same)


def test_eval_fraction_holds_out_a_fixed_disjoint_set(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{i}=", "answer": str(i)} for i in range(100)])
    first = load_task_data(TaskConfig(dataset=path, eval_fraction=0.2, seed=3))
    again = load_task_data(TaskConfig(dataset=path, eval_fraction=0.2, seed=3))
    assert len(first.eval_items) == 20 and len(first.items) == 80
    assert [i["row"] for i in first.eval_items] == [i["row"] for i in again.eval_items]
    assert not {i["row"] for i in first.eval_items} & {i["row"] for i in first.items}


def test_missing_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="task.dataset: .*nope.jsonl does not exist"):
        load_task_data(TaskConfig(dataset=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match="neither a file, a save_to_disk folder nor a dataset in the local cache"):
        load_task_data(TaskConfig(dataset="someone/not-cached-anywhere"))
    path = write_jsonl(tmp_path / "empty.jsonl", [{"x": 1}])
    with pytest.raises(ValueError, match=r"no usable rows .*missing_input"):
        load_task_data(TaskConfig(dataset=path))
    # The folder a dataset's files are in (data/arith), not a save_to_disk folder: the files in it are named.
    with pytest.raises(
        ValueError,
        match=rf"task.dataset: {tmp_path} is a folder, but not one `save_to_disk` "
        rf"wrote; name a file in it: {tmp_path / 'empty.jsonl'}",
    ):
        load_task_data(TaskConfig(dataset=str(tmp_path)))


def test_a_json_array_file_loads_like_jsonl(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "12=", "answer": "3"}, [1, 2], {"prompt": "4=", "answer": "4"}], indent=2))
    data = load_task_data(TaskConfig(dataset=str(path)))
    assert [(i["prompt"], i["row"]) for i in data.items] == [("12=", 1), ("4=", 3)]
    assert data.skipped == {"malformed_json": 1}
    path.write_text('[{"prompt": ')
    with pytest.raises(ValueError, match=r"task.dataset: .*rows.json is not valid JSON"):
        load_task_data(TaskConfig(dataset=str(path)))


def test_held_out_rows_are_named_and_counted_apart(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1=", "answer": "1"}, {"x": 1}])
    with pytest.raises(FileNotFoundError, match="task.eval_dataset: .*nope.jsonl does not exist"):
        load_task_data(TaskConfig(dataset=train, eval_dataset=str(tmp_path / "nope.jsonl")))
    held = write_jsonl(tmp_path / "held.jsonl", [{"question": "2="}] * 3)
    with pytest.raises(ValueError, match=r"task.eval_dataset: no usable rows .*missing_input.: 3"):
        load_task_data(TaskConfig(dataset=train, eval_dataset=held))
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "2=", "answer": "2"}, {"x": 1}, {"x": 2}])
    data = load_task_data(TaskConfig(dataset=train, eval_dataset=held))
    assert data.skipped == {"missing_input": 1, "eval_missing_input": 2}


@pytest.mark.parametrize(
    "task, error",
    [
        (dict(dataset="{tmp}/nope.jsonl", reward="math"), "task.dataset: .*nope.jsonl does not exist"),
        (
            dict(dataset="{tmp}/rows.jsonl", input_key="questoin", reward="math"),
            r"task.dataset: none of the first 2 rows .* is usable .*missing_input.*input_key='questoin'",
        ),
        (
            dict(dataset="{tmp}/rows.jsonl", eval_dataset="{tmp}/held.jsonl", reward="math"),
            "task.eval_dataset: .*held.jsonl does not exist",
        ),
        (
            dict(dataset="{tmp}/rows.jsonl"),
            r"task.reward: not set, and task.dataset needs a reward: name a built-in one "
            r"\(countdown, format, math\)",
        ),
        (
            dict(reward="math", rewards={"math": 1.0, "http://127.0.0.1:8000/score": 1.0}),
            r"task.rewards: http://127.0.0.1:8000/score is a reward model URL; give it as task.reward",
        ),
        (
            dict(reward="mathh"),
            r"task.reward: unknown reward 'mathh': neither a built-in reward \(countdown, format, "
            r"math\) nor 'module:callable' nor a reward model's",
        ),
        (
            dict(rewards={"math": 1.0, "fromat": 0.1}),
            r"task.rewards: unknown reward 'fromat': neither a built-in reward",
        ),
        (dict(reward="no_such_module:score"), r"task.reward: cannot import .*no module named 'no_such_module'"),
        (dict(reward="asyncrl.tasks.digits:nope"), r"task.reward: cannot import .*has no attribute 'nope'"),
        (dict(prompts="asyncrl.tasks.digits:nope", reward="math"), r"task.prompts: cannot import"),
    ],
)
def test_a_run_checks_its_task_before_any_process_starts(tmp_path, task, error):
    from asyncrl.tasks import check_task

    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1=", "answer": "1"}] * 2)
    task = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in task.items()}
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        check_task(TaskConfig(**task))
    check_task(TaskConfig(dataset=str(tmp_path / "rows.jsonl"), reward="test_task_data:no_import_needed"))


def test_prompt_builder_adds_the_system_prompt_and_the_chat_template():
    seen = []

    class Recording:
        def __call__(self, text):
            seen.append(text)
            return SimpleNamespace(input_ids=[1, 2])

    assert prompt_builder(TaskConfig(system_prompt="Answer briefly."), Recording())({"prompt": "12="}) == [1, 2]
    assert seen == ["Answer briefly.\n\n12="]
    templated = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-llama")  # its vocabulary: digits and "="
    templated.chat_template = (
        "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}0{% endif %}"
    )
    build = prompt_builder(TaskConfig(system_prompt="9", apply_chat_template=True), templated)
    assert build({"prompt": "12="}) == templated("9=12==0", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="has no chat template"):
        prompt_builder(TaskConfig(apply_chat_template=True), TOKENIZER)({"prompt": "x"})
    # Gemma's template raises on a system message: the error names the setting and the row, not Jinja alone.
    templated.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(
        ValueError,
        match=r"chat template failed on row 4: .*System role not supported.*leave "
        r"task.system_prompt unset",
    ):
        prompt_builder(TaskConfig(system_prompt="9", apply_chat_template=True), templated)({"prompt": "1", "row": 4})


def test_open_task_keeps_the_prompts_hook(tmp_path):
    task = open_task(TaskConfig(prompt_args={"num_prompts": 5, "length": 2}), TOKENIZER)
    assert len(task.items) == 5 and task.eval_items == [] and task.reward("12", {"answer": "12"}) == 1.0


def test_a_reward_module_in_the_working_directory_is_found_as_the_runs_processes_will_find_it(tmp_path, monkeypatch):
    """`python -m` puts the working directory on the run's processes' path, not on the `asyncrl` script's."""
    from asyncrl.tasks import check_task

    (tmp_path / "my_reward_here.py").write_text("def score(response, item):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    check_task(TaskConfig(reward="my_reward_here:score"))
    assert str(tmp_path) not in sys.path
    with pytest.raises(ValueError, match="no module named 'my_rewrd_here' in the working directory or on PYTHONPATH"):
        check_task(TaskConfig(reward="my_rewrd_here:score"))


def test_empty_and_non_scalar_labels_are_skipped_with_their_rows(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "labels.jsonl",
        [
            {"question": "1=", "answer": "1"},
            {"question": "2=", "answer": ""},  # row 2: empty
            {"question": "3=", "answer": "  "},  # row 3: blank
            {"question": "4=", "answer": "Work.\n#### "},  # row 4: a GSM8K solution with no answer
            {"question": "5=", "answer": [5]},  # row 5: a list
            {"question": "6=", "answer": {"value": 6}},  # row 6: an object
            {"question": "7=", "answer": 7.5},
            {"question": "8=", "answer": True},  # a yes/no label (BoolQ) is a label
        ],
    )
    with caplog.at_level(logging.WARNING):
        data = load_task_data(TaskConfig(dataset=path, input_key="question"))
    assert [(i["row"], i["label"]) for i in data.items] == [(1, "1"), (7, 7.5), (8, True)]
    assert data.skipped == {"missing_label": 3, "label_not_scalar": 2}
    for row, reason in ((2, "missing_label"), (4, "missing_label"), (5, "label_not_scalar"), (6, "label_not_scalar")):
        assert f"labels.jsonl row {row} skipped ({reason})" in caplog.text


def test_a_small_eval_fraction_holds_out_at_least_one_row_or_says_why_it_cannot(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{i}=", "answer": str(i)} for i in range(10)])
    data = load_task_data(TaskConfig(dataset=path, eval_fraction=0.01))  # round(0.1) would be none at all
    assert len(data.eval_items) == 1 and len(data.items) == 9
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "1=", "answer": "1"}])
    with pytest.raises(ValueError, match=r"task.eval_fraction: 0.05 of the 1 usable rows .* leaving none to train"):
        load_task_data(TaskConfig(dataset=one, eval_fraction=0.05))


def test_one_dataset_folder_gives_training_and_held_out_prompts_from_its_own_splits(tmp_path):
    import datasets

    folder = str(tmp_path / "dd")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"question": f"train q{i}", "answer": str(i)} for i in range(4)]),
            "test": datasets.Dataset.from_list([{"question": f"test q{i}", "answer": str(i)} for i in range(2)]),
        }
    ).save_to_disk(folder)
    data = load_task_data(TaskConfig(dataset=folder, eval_dataset=folder, input_key="question"))
    assert [i["prompt"] for i in data.eval_items] == ["test q0", "test q1"]
    assert [i["prompt"] for i in data.items] == [f"train q{i}" for i in range(4)]
    with pytest.raises(
        ValueError,
        match=r"task.eval_dataset: .* has splits \['test', 'train'\], not "
        r"task.eval_split='validation'",
    ):
        load_task_data(TaskConfig(dataset=folder, eval_dataset=folder, eval_split="validation", input_key="question"))
    same = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1=", "answer": "1"}])
    with pytest.raises(ValueError, match="task.eval_dataset: .*rows.jsonl is task.dataset's file"):
        load_task_data(TaskConfig(dataset=same, eval_dataset=same))


def test_files_as_editors_and_tools_write_them(tmp_path, caplog):
    import gzip

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    body = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "UPPER.JSONL").write_text(body)
    (tmp_path / "bom.jsonl").write_text(body, encoding="utf-8-sig")  # Windows editors, Excel exports
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(body.encode()))
    for name in ("UPPER.JSONL", "bom.jsonl", "rows.jsonl.gz"):
        data = load_task_data(TaskConfig(dataset=str(tmp_path / name), input_key="question"))
        assert [i["row"] for i in data.items] == [1, 2, 3], name
    latin1 = json.dumps({"question": "caf\u00e9", "answer": "4"}, ensure_ascii=False).encode("latin-1")
    (tmp_path / "mixed.jsonl").write_bytes(body.encode() + latin1 + b"\n" + body.encode())
    with caplog.at_level(logging.WARNING):
        data = load_task_data(TaskConfig(dataset=str(tmp_path / "mixed.jsonl"), input_key="question"))
    assert [i["row"] for i in data.items] == [1, 2, 3, 5, 6, 7] and data.skipped == {"not_utf8": 1}
    assert "mixed.jsonl row 4 skipped (not_utf8)" in caplog.text


def test_prompts_the_engine_could_not_take_are_skipped_alike_by_learner_and_generators(tmp_path):
    """max_model_len set, max_prompt_tokens not: rows the engine would refuse are skipped by row."""
    from asyncrl.config import load_config
    from asyncrl.tasks import load_items

    path = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "12=", "answer": "1"}, {"prompt": "1234567890" * 5, "answer": "2"}]
    )
    config = load_config(
        None,
        [
            f"--task.dataset={path}",
            "--task.reward=math",
            "--generator.vllm.max_model_len=20",
            "--generator.max_new_tokens=10",
        ],
    )
    items, _, skipped = load_items(config.prompt_task(), TOKENIZER)
    assert [i["row"] for i in items] == [1] and skipped == {"prompt_too_long": 1}


def test_a_dotted_key_reads_a_nested_column_as_verl_datasets_hold_their_labels(tmp_path):
    path = write_jsonl(
        tmp_path / "verl.jsonl",
        [
            {"question": "1+1=", "reward_model": {"style": "rule", "ground_truth": "2"}},
            {"question": "2+2=", "reward_model": {"style": "rule"}},  # row 2: no ground truth
            {"question": "3+3=", "reward_model.ground_truth": "6", "reward_model": {}},  # a column of that very name
        ],
    )
    data = load_task_data(TaskConfig(dataset=path, input_key="question", label_key="reward_model.ground_truth"))
    assert [(i["row"], i["label"]) for i in data.items] == [(1, "2"), (3, "6")]
    assert data.skipped == {"missing_label": 1}


def test_a_conversation_prompt_goes_through_the_chat_template_as_trl_and_verl_datasets_expect(tmp_path):
    from asyncrl.tasks import prompt_text

    user = {"role": "user", "content": "12="}
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [user], "reward_model": {"ground_truth": "12"}},
            {"prompt": [{"role": "system", "content": "9"}, user], "reward_model": {"ground_truth": "12"}},
            {
                "prompt": [user, {"role": "assistant", "content": "1"}],
                "reward_model": {"ground_truth": "1"},
            },  # answered
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}},  # no content
            {"prompt": [], "reward_model": {"ground_truth": "1"}},
        ],
    )
    data = load_task_data(TaskConfig(dataset=path, label_key="reward_model.ground_truth"))
    assert [i["row"] for i in data.items] == [1, 2] and data.skipped == {"input_not_text": 3}
    templated = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-llama")
    templated.chat_template = (
        "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}0{% endif %}"
    )
    build = prompt_builder(TaskConfig(system_prompt="8"), templated)  # a conversation needs no flag for it
    expected = templated("8=12==0", add_special_tokens=False).input_ids
    assert build(data.items[0]) == expected, "the system prompt goes first where the row has none"
    assert build(data.items[1]) == templated("9=12==0", add_special_tokens=False).input_ids, "the row's own"
    assert prompt_text(data.items[1]) == "12="
    with pytest.raises(ValueError, match=r"no chat template \(row 1 is a conversation\)"):
        prompt_builder(TaskConfig(), TOKENIZER)(data.items[0])


def test_the_start_up_check_builds_the_first_prompt_through_the_models_chat_template(tmp_path):
    from asyncrl.tasks import check_task

    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "1="}], "answer": "1"}])
    task = TaskConfig(dataset=path, reward="math")
    check_task(task)  # without the model folder: the rows alone
    with pytest.raises(ValueError, match=r"the model's tokenizer has no chat template \(row 1 is a conversation\)"):
        check_task(task, str(ROOT / "assets/tiny-llama"))


def test_a_tokenizer_that_cannot_encode_the_data_is_named_before_any_process_starts():
    """The quickstart's tiny model on word problems: every generator failed with the tokenizer library's
    "WordLevel error: Missing [UNK] token"."""
    from asyncrl.tasks import check_task

    task = TaskConfig(
        dataset=str(ROOT / "data/arith/train.jsonl"), input_key="question", label_key="answer", reward="math"
    )
    with pytest.raises(
        ValueError,
        match=r"model.path: the model's tokenizer cannot encode the prompt of row 1 "
        r"\(Exception: WordLevel error.*is model.path the model meant for this data",
    ):
        check_task(task, str(ROOT / "assets/tiny-llama"))
    check_task(
        TaskConfig(
            dataset=str(ROOT / "data/copy/train.jsonl"),
            input_key="question",
            label_key="label",
            reward="asyncrl.tasks.digits:digit_reward",
        ),
        str(ROOT / "assets/tiny-llama"),
    )
