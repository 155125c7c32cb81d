"""Multi-turn episodes on the real vLLM engine: turns added while others run, and the learner's log-probs of a
whole trajectory equal to the generator's on every token the model sampled."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from conftest import ROOT  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.config import EpisodeConfig  # noqa: E402
from asyncrl.envs.chat import ChatRenderer  # noqa: E402
from asyncrl.envs.hint import HintEnv  # noqa: E402
from generators.base import SamplingParams  # noqa: E402
from generators.episodes import EpisodeRunner, episode_rollout  # noqa: E402
from generators.turns import VllmTurns, turn_engine  # noqa: E402
from generators.vllm_backend import VllmBackend  # noqa: E402
from learners.packing import pack  # noqa: E402

pytestmark = pytest.mark.slow
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(shutil.copytree(ROOT / "assets/tiny-agent", tmp_path_factory.mktemp("agent") / "model"))


@pytest.fixture(scope="module")
def episodes(model_dir):
    backend = VllmBackend(str(model_dir), max_model_len=256, enable_prefix_caching=True)
    engine = turn_engine(backend)
    assert isinstance(engine, VllmTurns)
    runner = EpisodeRunner(
        EpisodeConfig(max_turns=3),
        HintEnv,
        ChatRenderer(backend.tokenizer, "template"),
        engine,
        SamplingParams(n=8, max_new_tokens=6, temperature=TEMPERATURE),
        max_tokens=120,
        version=lambda: backend.version,
    )
    tickets = [(f"g{i}", i, {"prompt": "?", "answer": f"{i}{i + 1}{i + 2}"}) for i in range(4)]
    steps = []
    try:
        groups = dict(runner.run(tickets, lambda: steps.append(engine.busy)))
    finally:
        runner.close()
        backend.close()
    return [e for group in groups.values() for e in group]


def test_every_episode_ends_and_some_take_more_than_one_turn(episodes):
    assert len(episodes) == 32 and all(e.done and not e.dropped for e in episodes)
    assert max(e.turns for e in episodes) >= 2  # a random model calls the hint now and then
    assert all(len(e.mask) == len(e.ids) == len(e.logprobs) == len(e.versions) for e in episodes)


def test_the_learners_log_probs_of_a_whole_episode_match_the_generators_on_the_models_tokens(episodes, model_dir):
    rollouts = [episode_rollout(e, 8, 0.0, EpisodeConfig(truncated="keep"), "gen", 0.0) for e in episodes]
    multi = [r for r in rollouts if 0 in r.loss_mask]
    assert multi, "no episode had an environment reply"
    ids, attention, _, targets, behaviour, mask, _, _ = pack(multi, packed=False)[:8]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float() / TEMPERATURE
    learner = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    on = mask.bool()
    assert int(on.sum()) == sum(r.trained_tokens for r in multi)
    assert (learner[on] - behaviour[on]).abs().max() < 1e-4
    # where the mask is 0 the generator recorded nothing: those tokens were written by the environment
    assert behaviour[(~on) & (targets != 0)].abs().max() == 0
