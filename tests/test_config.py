import re
import subprocess
import sys
from pathlib import Path

import msgspec
import msgspec.inspect
import pytest
import yaml
from conftest import ROOT

from asyncrl.config import ConfigError, RunConfig, describe_keys, load_config, to_yaml

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path, tmp_path):
    from asyncrl.launch.preflight import run_config

    config, _ = run_config(str(path), [f"--run_dir={tmp_path}"])  # with what asyncrl run adds
    assert isinstance(config, RunConfig)
    if Path(ROOT / config.model.path).exists() or Path(config.model.path).exists():
        return
    # A model the user imports first: the config must say how, with a name asyncrl knows.
    from asyncrl.launch.models import SOURCES

    imports = re.findall(r"asyncrl model import (\S+) (\S+)", path.read_text())
    assert imports, f"{path.name}: model.path {config.model.path} does not exist and no import command is given"
    ((name, target),) = imports
    assert name in SOURCES and target == config.model.path


def test_dotted_overrides_in_both_forms():
    config = load_config(ROOT / "configs/quickstart.yaml", ["--learner.lr", "1e-5", "generator.stop=[x, y]"])
    assert config.learner.lr == pytest.approx(1e-5)
    assert config.generator.stop == ["x", "y"]


def test_text_settings_take_the_value_as_written():
    # As YAML, "#### <number>" is a comment (None), "yes" a boolean and "0123" the number 123.
    config = load_config(
        ROOT / "configs/quickstart.yaml",
        ["--task.system_prompt", "Solve it. End with: #### <number>", "--name=yes", "--run_dir=0123"],
    )
    assert (config.task.system_prompt, config.name, config.run_dir) == (
        "Solve it. End with: #### <number>",
        "yes",
        "0123",
    )
    assert load_config(None, ["--task.system_prompt=#### <number>"]).task.system_prompt == "#### <number>"
    assert load_config(None, ["--task.system_prompt=null"]).task.system_prompt is None
    assert load_config(None, ["--name='quoted'"]).name == "quoted"  # YAML's quotes are read as ever


def test_bad_value_names_key_and_where_it_was_set(tmp_path):
    with pytest.raises(ConfigError, match=r"^override --learner.lr: .*\$\.learner\.lr"):
        load_config(ROOT / "configs/quickstart.yaml", ["--learner.lr", "fast"])
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=rf"^{path}: .*\$\.learner\.lr"):
        load_config(path)


def test_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: unknown key `learner.lrr`; did you mean `learner.lr`\?"):
        load_config(path)


def test_cross_process_invariants_are_checked():
    with pytest.raises(ConfigError, match=r"max_staleness"):
        load_config(None, ["--staleness.max_staleness", "-1"])
    with pytest.raises(ConfigError, match=r"coordinator.address"):
        load_config(None, ["--coordinator.address", "tcp://127.0.0.1:5555"])
    redis = ["buffer.type=redis", "learner.checkpoint_every_steps=5", "learner.batch_timeout_s=30"]
    with pytest.raises(ConfigError, match=r"must be below learner.batch_timeout_s \(30\).*buffer\.outage_tolerance_s"):
        load_config(None, redis)
    assert load_config(None, [*redis, "buffer.outage_tolerance_s=20"]).buffer.outage_tolerance_s == 20


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(ROOT / "configs/quickstart.yaml", ["--learner.total_steps", "7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config


def _walk(info: msgspec.inspect.StructType, prefix: str = "") -> dict[str, object]:
    """Every leaf field of a config Struct as ``{dotted key: default}``, found independently of describe_keys."""
    keys: dict[str, object] = {}
    for f in info.fields:
        if isinstance(f.type, msgspec.inspect.StructType):
            keys.update(_walk(f.type, f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    return keys


ALL_KEYS = _walk(msgspec.inspect.type_info(RunConfig))
GENERATOR_SECTIONS = (
    "run_dir",
    "trace",
    "model",
    "task",
    "buffer",
    "coordinator",
    "generator",
    "eval",
    "push",
    "prometheus",
)


KEY_LINE = re.compile(r"^  (?P<key>[\w.]+) +(?P<type>.+?) = (?P<default>.+?)(?: {2,}(?P<comment>.*))?$")


def _listed(text: str) -> dict[str, re.Match]:
    """The key lines of a help text (``  key  type = default  comment``) by dotted key."""
    return {m["key"]: m for m in map(KEY_LINE.match, text.splitlines()) if m}


def _plain(value: object) -> object:
    return msgspec.json.decode(msgspec.json.encode(value))  # a tuple default compares as the list YAML gives


def test_describe_keys_lists_exactly_the_fields_of_the_config_types():
    # Walked from the types, so a field added to any section shows up without editing a help text.
    assert set(_listed(describe_keys())) == set(ALL_KEYS)
    assert set(_listed(describe_keys(["learner", "run_dir"]))) == {
        k for k in ALL_KEYS if k.startswith("learner.") or k == "run_dir"
    }


def test_describe_keys_shows_types_and_defaults_that_parse_back():
    listed = _listed(describe_keys())
    for key, line in listed.items():
        # The default is written as it would be typed as an override (parsed as YAML).
        assert yaml.safe_load(line["default"]) == _plain(ALL_KEYS[key]), key
    assert listed["buffer.type"]["type"] == "zmq|inproc|redis"
    assert listed["learner.zero_stage"]["type"] == "0|1|2|3 | None"
    assert listed["learner.weights_dir"]["type"] == "str | None"
    assert listed["learner.betas"]["type"] == "tuple[float, float]"
    assert listed["task.prompt_args"]["type"] == "dict[str, Any]"
    assert listed["learner.lr"]["type"] == "float"


def test_describe_keys_comments_come_from_the_source():
    source = "\n".join(path.read_text() for path in sorted((ROOT / "asyncrl/config").glob("*.py")))
    comments = " ".join(line.split("#", 1)[1].strip() for line in source.splitlines() if "#" in line)
    lines = describe_keys().splitlines()
    described = [m["comment"] for m in map(KEY_LINE.match, lines) if m and m["comment"]]
    described += [line[len("  # ") :] for line in lines if line.startswith("  # ")]
    assert len(described) > 20
    for text in described:
        assert text in comments, text
    assert _listed(describe_keys(["model"]))["model.random_init"]["comment"] == (
        "build from the folder's config.json alone (benchmarks)"
    )


def test_describe_keys_rejects_unknown_sections():
    with pytest.raises(ValueError, match="lerner"):
        describe_keys(["lerner"])


@pytest.mark.parametrize(
    "module, argv, sections",
    [
        ("asyncrl.launch.cli", ["run", "--help"], None),
        ("asyncrl.launch.cli", ["status", "--help"], ("coordinator",)),
        ("learners.cli", ["--help"], None),
        ("generators.cli", ["--help"], GENERATOR_SECTIONS),
    ],
    ids=["run", "status", "learner", "generator"],
)
def test_cli_help_lists_every_key_it_reads_with_its_default(module, argv, sections, capsys):
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 0
    listed = _listed(capsys.readouterr().out)
    expected = {k: v for k, v in ALL_KEYS.items() if sections is None or k.split(".")[0] in sections}
    assert set(expected) <= set(listed)
    for key, default in expected.items():
        assert yaml.safe_load(listed[key]["default"]) == _plain(default), key


HELP_SCRIPT = """
import sys
from {module} import main
try:
    main({argv!r})
except SystemExit as exit:
    heavy = sorted(m for m in ("torch", "deepspeed", "transformers", "vllm") if m in sys.modules)
    print("heavy modules:", heavy, file=sys.stderr)
    sys.exit(exit.code)
"""


@pytest.mark.parametrize(
    "module, argv",
    [
        ("asyncrl.launch.cli", ["run", "--help"]),
        ("learners.cli", ["--help"]),
        ("generators.cli", ["--help"]),
    ],
    ids=["run", "learner", "generator"],
)
def test_help_exits_0_without_importing_torch(module, argv):
    proc = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT.format(module=module, argv=argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "heavy modules: []" in proc.stderr
    assert "learner.lr" in proc.stdout or "generator.temperature" in proc.stdout


def test_asyncrl_runs_checks_import_no_torch_so_its_processes_start_at_once(tmp_path):
    """What `asyncrl run` does before it starts the learner and generators (about 1.5 s of every run's start-up
    once went to importing torch for the LoRA check, which needs it only with learner.lora on)."""
    script = (
        "import sys\n"
        "from asyncrl.launch.preflight import prepare\n"
        f"prepare({str(ROOT / 'configs/quickstart.yaml')!r}, [], {str(tmp_path / 'run')!r}, free_ports=True)\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'vllm') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_asyncrl_run_shares_the_cores_among_its_processes_unless_the_config_says():
    from asyncrl.launch.preflight import thread_overrides

    config = load_config(str(ROOT / "configs/quickstart.yaml"), [])
    assert thread_overrides(config, cores=2) == ["--learner.torch_threads=1", "--generator.torch_threads=1"]
    assert thread_overrides(config, cores=16) == ["--learner.torch_threads=8", "--generator.torch_threads=8"]
    wide = load_config(str(ROOT / "configs/quickstart.yaml"), ["generator.replicas=3", "learner.torch_threads=2"])
    assert thread_overrides(wide, cores=16) == ["--generator.torch_threads=4"]
    assert thread_overrides(wide, cores=2) == ["--generator.torch_threads=1"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("--task.reward_timeout_s=0", "task.reward_timeout_s"),
        ("--learner.lr=-1e-3", "learner.lr"),
        ("--algo.value_clip=-1", "algo.value_clip"),
        ("--generator.weight_load_timeout_s=-1", "generator.weight_load_timeout_s"),  # ZeroMQ: -1 s waits forever
        ("--push.timeout_s=0", "push.timeout_s"),
        ("--ray.drain_timeout_s=0", "ray.drain_timeout_s"),
    ],
)
def test_a_setting_out_of_its_range_is_named(override, key):
    with pytest.raises(ConfigError, match=rf"must be > 0.*`\$\.{key}`"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--learner.total_step=5"],
            "override --learner.total_step: unknown key `learner.total_step`; did you mean `learner.total_steps`?",
        ),
        (["--lerner.lr=1e-3"], "override --lerner.lr: unknown key `lerner`; did you mean `learner`?"),
        (["--learner.lr=abc"], "override --learner.lr: Expected `float`, got `str`"),
        (
            ["--algo.advantage=grpoo"],
            "override --algo.advantage: Invalid enum value 'grpoo' - at `$.algo.advantage` "
            "(expected one of grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae)",
        ),
        (["--learner.lr", "--learner.total_steps=3"], "override --learner.lr has no value (write --learner.lr=VALUE)"),
        # a TRL / verl user's names: the key it is here, not the nearest spelling (batch_size -> batch_timeout_s)
        (
            ["--learner.batch_size=64"],
            "override --learner.batch_size: unknown key `learner.batch_size`; that setting "
            "is `learner.groups_per_step` here (prompts per step",
        ),
        (
            ["--generator.num_generations=8"],
            "override --generator.num_generations: unknown key "
            "`generator.num_generations`; that setting is `generator.samples_per_prompt`",
        ),
        (
            ["--learning_rate=1e-6"],
            "override --learning_rate: unknown key `learning_rate`; that setting is `learner.lr`",
        ),
    ],
)
def test_an_override_error_names_the_override_and_the_key_meant(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "ci-tiny.yaml", overrides)
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["--generator.devices=1"], "override --generator.devices: lists fewer GPUs than generator.vllm.tensor"),
        (["--ray.generator_gpus=1"], "override --ray.generator_gpus: is below generator.vllm.tensor_parallel_size"),
    ],
)
def test_a_tensor_parallel_engine_given_fewer_gpus_than_its_workers_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(ROOT / "configs" / "quickstart.yaml", ["--generator.vllm.tensor_parallel_size=2", *overrides])
    assert load_config(ROOT / "configs" / "quickstart.yaml", ["--ray.generator_gpus=0.5"])  # one worker, half a GPU


@pytest.mark.parametrize("key", ["learner.keep_versions", "learner.keep_checkpoints"])
def test_keeping_no_versions_or_checkpoints_is_refused(key):
    # 0 kept everything (list[:-0] is empty) and filled the disk; -1 deleted each version as it was announced.
    for value in (0, -1):
        with pytest.raises(ConfigError, match=rf"must be >= 1.*`\$\.{key}`"):
            load_config(ROOT / "configs" / "ci-tiny.yaml", [f"--{key}={value}"])


def test_one_sample_for_pass_at_k_is_refused_since_it_would_overwrite_the_greedy_pass_at_1():
    with pytest.raises(ConfigError, match=r"eval.k.*must be >= 2: pass@1 is always the greedy answer's"):
        load_config(ROOT / "configs" / "ci-tiny.yaml", ["--eval.k=1"])


def test_nucleus_sampling_is_refused_since_the_learner_scores_the_whole_distribution():
    with pytest.raises(
        ConfigError,
        match=r"must be 1: the learner scores each token under the whole distribution"
        r".*`\$\.generator\.top_p`",
    ):
        load_config(ROOT / "configs" / "ci-tiny.yaml", ["--generator.top_p=0.9"])


def test_a_section_given_twice_is_an_error_not_the_last_one_silently(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  lr: 1.0e-3\nstaleness:\n  max_staleness: 1\nlearner:\n  total_steps: 3\n")
    with pytest.raises(ConfigError, match="`learner` is given twice"):
        load_config(path)


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_baseline_needs_two_samples_per_prompt(advantage):
    with pytest.raises(ConfigError, match=rf"must be >= 2 with algo.advantage {advantage}"):
        load_config(None, ["--generator.samples_per_prompt=1", f"--algo.advantage={advantage}"])
    assert load_config(None, ["--generator.samples_per_prompt=1", "--algo.advantage=reinforce_pp"])


def test_prompts_the_engine_would_refuse_are_skipped_without_the_limit_being_written_into_the_config(tmp_path):
    # vLLM refuses a prompt that fills max_model_len (a response past it is cut, finish "length", not refused).
    with pytest.raises(
        ConfigError,
        match=r"must be below generator.vllm.max_model_len \(1024\).*`\$\.task"
        r"\.max_prompt_tokens`",
    ):
        load_config(None, ["--generator.vllm.max_model_len=1024", "--task.max_prompt_tokens=1024"])
    config = load_config(None, ["--generator.vllm.max_model_len=1024", "--generator.max_new_tokens=256"])
    assert config.prompt_task().max_prompt_tokens == 1023, "unset: what the engine takes"
    assert config.task.max_prompt_tokens is None, "derived, not written back"
    (tmp_path / "config.yaml").write_text(to_yaml(config))  # the run folder's copy reads as the config given
    again = load_config(tmp_path / "config.yaml", ["--generator.vllm.max_model_len=8192"])
    assert again.prompt_task().max_prompt_tokens == 8191
    assert (
        load_config(None, ["--generator.vllm.max_model_len=1024", "--task.max_prompt_tokens=100"])
        .prompt_task()
        .max_prompt_tokens
        == 100
    )
    assert (
        load_config(None, ["--generator.vllm.max_model_len=1024", "--generator.backend=transformers"])
        .prompt_task()
        .max_prompt_tokens
        is None
    ), "the vllm section does not bind the transformers backend"


def test_a_dataset_without_a_reward_is_refused_rather_than_scored_by_the_digit_reward():
    with pytest.raises(
        ConfigError,
        match=r"task.reward: not set, and task.dataset needs a reward: name a built-in "
        r"one \(countdown, format, math\).*`\$\.task\.reward`",
    ):
        load_config(None, ["--task.dataset=data/arith/train.jsonl"])
    with pytest.raises(ConfigError, match=r"task.reward: not set, and task.prompts \(mine:prompts\) needs"):
        load_config(None, ["--task.prompts=mine:prompts"])
    assert load_config(None, ["--task.dataset=x.jsonl", "--task.reward=math"]).task.reward_name() == "math"
    assert load_config(None, ["--task.dataset=x.jsonl", "--task.rewards={math: 1.0}"]).task.rewards == {"math": 1.0}
    assert load_config(None, []).task.reward_name() == "asyncrl.tasks.digits:digit_reward", "the digit prompts' own"


def test_held_out_prompts_from_the_training_split_are_refused():
    with pytest.raises(ConfigError, match=r"held-out prompts would be the training prompts.*`\$\.task\.eval_split`"):
        load_config(
            None, ["--task.dataset=d", "--task.eval_dataset=d", "--task.eval_split=train", "--task.reward=math"]
        )
    config = load_config(None, ["--task.dataset=d", "--task.eval_dataset=d", "--task.reward=math"])
    assert (config.task.split, config.task.eval_split) == ("train", "test")


@pytest.mark.parametrize(
    "url, extra, refused",
    [
        ("redis://10.1.2.3:6379/0", [], True),
        ("redis://redis.internal:6379/0", [], True),
        ("redis://10.1.2.3:6379/0", ["--buffer.redis_password_file=pw"], False),
        ("redis://127.0.0.1:6379/0", [], False),
    ],
)
def test_a_redis_beyond_this_machine_needs_credentials(url, extra, refused):
    """As a ZeroMQ address beyond loopback needs its CURVE secret."""
    overrides = ["--buffer.type=redis", f"--buffer.redis_url={url}", "--learner.checkpoint_every_steps=10", *extra]
    if refused:
        with pytest.raises(ConfigError, match="buffer.redis_url: reaches Redis beyond this machine"):
            load_config(None, overrides)
    else:
        assert load_config(None, overrides).buffer.redis_url == url


def test_each_generator_replica_gets_its_own_push_rank_and_metrics_port():
    config = load_config(None, ["--generator.push_rank=1", "--prometheus.generator_port=9100"])
    assert config.replica_overrides(2) == ["--generator.push_rank=3", "--prometheus.generator_port=9102"]
    assert load_config(None, []).replica_overrides(1) == ["--generator.push_rank=2"]


def test_with_tensor_parallelism_each_engines_workers_take_consecutive_push_ranks():
    """Each worker of an engine joins the push group: replica i starts at 1 + i x tensor_parallel_size."""
    settings = [
        "--push.address=127.0.0.1:29500",
        "--push.secret_file=s",
        "--push.generators=2",
        "--generator.replicas=2",
        "--generator.vllm.tensor_parallel_size=2",
    ]
    config = load_config(None, settings)
    assert [config.replica_overrides(i)[0] for i in range(2)] == ["--generator.push_rank=1", "--generator.push_rank=3"]
    load_config(None, [*settings, "--generator.push_rank=3"])  # the second engine's first worker
    for rank in (2, 4, 5):
        with pytest.raises(ConfigError, match=r"generator.push_rank.*1 \+ a multiple of .*\(2\) in 1..4"):
            load_config(None, [*settings, f"--generator.push_rank={rank}"])


def test_a_run_folders_config_from_before_the_bucket_key_was_renamed_still_loads(tmp_path, caplog):
    old = tmp_path / "config.yaml"  # what to_yaml wrote into every run folder before
    old.write_text("learner:\n  zero_bucket_mb: 500\n")
    assert load_config(str(old)).learner.zero_bucket_elements == 500 * 2**20
    assert "zero_bucket_mb: 500 read as learner.zero_bucket_elements: 524288000" in caplog.text
    assert load_config(None, ["--learner.zero_bucket_mb=50"]).learner.zero_bucket_elements == 50 * 2**20
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, ["--learner.zero_bucket_mb=50", "--learner.zero_bucket_elements=1000"])


def test_a_redis_password_goes_in_its_file_not_in_the_url():
    with pytest.raises(ConfigError, match="buffer.redis_url: holds a password.*buffer.redis_password_file"):
        load_config(
            None,
            [
                "--buffer.type=redis",
                "--buffer.redis_url=rediss://:s3cret@10.1.2.3:6379/0",
                "--learner.checkpoint_every_steps=10",
            ],
        )


@pytest.mark.parametrize(
    "old, new", [("learner.clip_eps", "algo.clip_eps"), ("ray.stop_timeout_s", "learner.stop_timeout_s")]
)
def test_a_moved_key_names_where_it_went(tmp_path, old, new):
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: 0.3\n")
    with pytest.raises(ConfigError, match=rf"`{re.escape(old)}` is now `{re.escape(new)}`"):
        load_config(path, [])


def test_each_local_generator_gets_one_engines_worth_of_gpus():
    """With tensor parallelism a generator's engine spans several GPUs: each generator sees that many."""
    from asyncrl.launch.local import generator_devices

    def devices(tp: int, replicas: int, gpus: str = "0,1,2,3") -> list[str | None]:
        config = load_config(
            None,
            [
                f"--generator.devices={gpus}",
                f"--generator.replicas={replicas}",
                f"--generator.vllm.tensor_parallel_size={tp}",
            ],
        )
        return [generator_devices(config, i) for i in range(replicas)]

    assert devices(1, 4) == ["0", "1", "2", "3"]
    assert devices(2, 2) == ["0,1", "2,3"]
    assert devices(4, 1) == ["0,1,2,3"]
    assert devices(1, 6) == ["0", "1", "2", "3", "0", "1"]  # more generators than GPUs: they share, in turn
    assert generator_devices(load_config(None, []), 0) is None
