"""Do episodes that wait on their tools hold up generation? Samples/s with a slow tool against an instant one.

    python bench/episode_bench.py                                   # CPU: the tiny agent model
    python bench/episode_bench.py --model models/smollm2-135m --groups 64 --new-tokens 64   # a GPU

Every episode has ``--turns`` model turns of exactly ``--new-tokens`` tokens
each (the engine ignores EOS) and between two turns an environment step that
waits ``--delay-s`` (a tool call on the network, a sandbox), in a thread, as a
plain environment's step runs. A round is ``3 * --groups`` tickets: ``--groups``
start at once, and half as many more whenever fewer than half of those
episodes are in flight, as a generator takes a request's worth of tickets
(``generator.groups_per_request``) while its episodes run. The same engine runs both sides, alternately,
``--repeats`` times each: with an instant environment, and with the slow one.
The record is the slow side's samples/s (episodes per second of generation)
beside the instant side's, and their ratio: 1.0 means waiting on tools costs
nothing, because the engine samples the other episodes meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402


class WaitingEnv:
    """``turns`` model turns; each answered after ``delay_s``, as a slow tool would be."""

    def __init__(self, item: dict[str, Any], delay_s: float, turns: int) -> None:
        self.item, self.delay_s, self.turns = item, delay_s, turns

    def reset(self):
        from asyncrl.envs import Observation

        return Observation([{"role": "user", "content": self.item["prompt"]}])

    def step(self, turn):
        from asyncrl.envs import Feedback

        if turn.index + 1 >= self.turns:
            return Feedback(reward=0.0, done=True)
        time.sleep(self.delay_s)
        return Feedback([{"role": "tool", "content": "42"}])


def run_side(runner, tickets: list, delay_s: float, holder: dict, groups: int, n: int) -> float:
    """One round: every ticket's episodes to their end, ``groups`` tickets at the start and ``groups / 2``
    more whenever fewer than half of those episodes are in flight, as a generator takes a request's worth of
    tickets while its episodes run; returns samples (episodes) per second."""
    holder["delay_s"] = delay_s
    chunk = max(1, groups // 2)
    left = list(tickets[groups:])

    def refill() -> list:
        taken, left[:] = left[:chunk], left[chunk:]
        return taken

    started = time.perf_counter()
    episodes = runner.run(tickets[:groups], lambda: None, refill=refill, refill_below=groups * n // 2)
    done = sum(len(group) for _, group in episodes)
    return done / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "assets/tiny-agent"))
    parser.add_argument("--groups", type=int, default=32, help="tickets per round")
    parser.add_argument("--n", type=int, default=8, help="episodes per ticket")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--delay-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=256, help="the tiny model's; 2048 for SmolLM2")
    parser.add_argument("--out", default=None, help="also write the report here (JSON)")
    parser.add_argument("--commit", default=None)
    records.add_argument(parser, "episode_bench")
    args = parser.parse_args(argv)

    from asyncrl.config import EpisodeConfig
    from asyncrl.envs.chat import ChatRenderer
    from generators.base import SamplingParams
    from generators.episodes import EpisodeRunner
    from generators.turns import turn_engine
    from generators.vllm_backend import VllmBackend

    backend = VllmBackend(args.model, max_model_len=args.max_model_len, enable_prefix_caching=True)
    backend.ignore_eos = True
    holder = {"delay_s": 0.0}
    runner = EpisodeRunner(
        EpisodeConfig(max_turns=args.turns, workers=args.groups * args.n),
        lambda item: WaitingEnv(item, holder["delay_s"], args.turns),
        ChatRenderer(backend.tokenizer, "template"),
        turn_engine(backend),
        SamplingParams(n=args.n, max_new_tokens=args.new_tokens),
    )
    sides: dict[str, list[float]] = {"instant": [], "slow": []}
    try:
        run_side(runner, [("warm", 0, {"prompt": "1"})], 0.0, holder, 1, args.n)  # compile, allocate
        for r in range(args.repeats):
            for side, delay in (("instant", 0.0), ("slow", args.delay_s)):
                stream = 3 * args.groups
                tickets = [(f"{side}{r}-{g}", g, {"prompt": str(g)}) for g in range(stream)]
                sides[side].append(run_side(runner, tickets, delay, holder, args.groups, args.n))
                print(f"round {r} {side}: {sides[side][-1]:.1f} samples/s", flush=True)
    finally:
        runner.close()
        backend.close()
    ratio = statistics.median(sides["slow"]) / statistics.median(sides["instant"])
    settings = {k: getattr(args, k) for k in ("groups", "n", "turns", "new_tokens", "delay_s")}
    settings["admission"] = "3 x groups tickets a round; groups at once, groups / 2 more below half in flight"
    report = {"model": Path(args.model).name, **settings, "samples_per_s": sides, "ratio_of_medians": ratio}
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    at = stamp(commit=args.commit)
    record = records.measure(
        at,
        bench="episode_bench",
        case=f"{Path(args.model).name}, {args.turns} turns, tool {args.delay_s:g} s",
        metric="samples_per_s",
        unit="samples/s",
        repeats=sides["slow"],
        vs=records.peer("instant tool", sides["instant"]),
        settings=settings,
        notes="an environment step that waits delay_s between turns, against one that does not; same engine",
    )
    records.write(args.records, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
