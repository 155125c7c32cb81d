"""The generator against vLLM's ceiling on a run's own workload: one engine, one process, the same prompts.

    python bench/generator_ceiling.py configs/arith-smollm2.yaml --out bench/results/generator_ceiling.json
    python bench/generator_ceiling.py configs/copy-cpu.yaml --generator.backend=vllm --groups 64   # CPU

The engine is the one a generator of ``CONFIG`` opens (its ``generator.vllm``
settings and ``gpu_memory_utilization`` share); the prompts are the config's
training prompts, ``generator.samples_per_prompt`` samples each, up to
``generator.max_new_tokens``, at its temperature. Each case draws the same
``--groups`` prompts (a different slice per round) and reports samples/s and
response tokens/s over ``--rounds`` after a warm-up:

* ``vllm``: plain ``LLM.generate`` with every prompt submitted at once, the
  sampled token's log-prob asked for (what a generator needs), no per-request
  seed, no detokenizing (token ids are what a generator needs): the ceiling.
* ``vllm-engine``: the same requests added to ``LLM``'s engine and stepped to
  the end with nothing else (no ``LLM.generate`` wrapper, nothing of the
  generator's): vLLM's own loop, what the backend's step hook adds to.
* ``vllm-window``: the same engine loop holding as many requests as the
  stream does (below), a new one in as each finishes: the stream's ceiling at
  the stream's concurrency, which tells the generator's cost apart from the
  cost of holding fewer sequences (or from CUDA graphs captured only up to a
  batch size, 512 in vLLM 0.26).
* ``vllm-nologprobs``: ``vllm`` without the sampled token's log-prob: what
  computing it costs the engine.
* ``vllm-detokenize``: the same at ``SamplingParams``' default, every token
  detokenized as it comes. On a small model the engine's output processing
  is what limits it (on one H100, SmolLM2-135M: 134 samples/s, where the
  generator's stream made 301).
* ``backend``: the generator's backend with every prompt in flight at once.
* ``batches``: a request's worth of groups (``generator.groups_per_request``)
  sampled to the last before the next goes in: the generator before it kept
  its engine full.
* ``stream``: :class:`generators.base.RequestStream` keeping as many groups
  in flight as the staleness bound admits (``(max_staleness + 1) x
  learner.groups_per_step``), a new one in as each finishes: the generator now.
* ``stream+eval`` and ``batches+eval``: the same with the config's held-out
  evaluation at its share (``eval.max_items`` prompts, greedy and ``eval.k``
  samples, per ``eval.every_steps`` steps of ``learner.groups_per_step``
  groups), interleaved in the stream, or run alone between batches as before.
  Their samples/s count training samples only: the evaluation's cost. Under
  ``--eval.max_share`` the evaluation gets no more than the learner would
  hand out.

One record per case, with the ratio to ``vllm`` in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from asyncrl.control.evaluation import earned_per_training  # noqa: E402
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

CASES = (
    "vllm",
    "vllm-engine",
    "vllm-window",
    "vllm-nologprobs",
    "vllm-detokenize",
    "backend",
    "batches",
    "stream",
    "stream+eval",
    "batches+eval",
)


class Workload:
    """A config's engine, prompts and sampling, and the cases run on them."""

    def __init__(self, config: Any, groups: int) -> None:
        from asyncrl.tasks import open_task
        from generators import open_backend
        from generators.base import sampling_params

        self.config, self.groups = config, groups
        self.backend = open_backend(config)
        task = open_task(config.prompt_task(), self.backend.tokenizer)
        self.prompts = [task.prompt_ids(item) for item in task.items]
        self.eval_prompts = [task.prompt_ids(item) for item in task.eval_items][: config.eval.max_items or None]
        self.params = sampling_params(config.generator)
        self.window = (config.staleness.max_staleness + 1) * config.learner.groups_per_step
        steps = groups / config.learner.groups_per_step
        every = config.eval.every_steps
        # evaluation prompts per training group, as the run would evaluate
        self.eval_share = len(self.eval_prompts) / (every * config.learner.groups_per_step) if every else 0.0
        earned = earned_per_training(config.eval.max_share)
        if earned is not None:  # the most the learner hands out under eval.max_share, in prompts per group
            self.eval_share = min(self.eval_share, earned * config.generator.samples_per_prompt / (config.eval.k + 1))
        self._round = 0
        print(f"{len(self.prompts)} prompts; {groups} groups a round ({steps:g} steps), window {self.window}")

    def draw(self) -> list[list[int]]:
        start = (self._round * self.groups) % max(1, len(self.prompts) - self.groups)
        self._round += 1
        return self.prompts[start : start + self.groups]

    def requests(self, prompts: list[list[int]], prefix: str = "g") -> list:
        from generators.base import GenerationRequest

        return [GenerationRequest(f"{prefix}{self._round}-{i}", p) for i, p in enumerate(prompts)]

    def eval_runs(self) -> list:
        from asyncrl.wire.protocol import EvalTicket
        from generators.evaluate import eval_runs

        gen = self.config.generator
        k, tokens = self.config.eval.k, gen.max_new_tokens
        ticket = EvalTicket(version=0, indices=[], k=k, temperature=self.config.eval.temperature, max_new_tokens=tokens)
        return [params for params, _ in eval_runs(ticket, tuple(gen.stop))]

    # ------------------------------------------------------------------ cases: (training samples, tokens)
    def plain_params(self, detokenize: bool = False, logprobs: bool = True):
        """Plain vLLM's sampling for the config's: the sampled token's log-prob, no per-request seed, each
        request's ``n`` answers once they are all done (as ``LLM.generate`` asks for them)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = self.params
        return SamplingParams(
            n=p.n,
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            logprobs=0 if logprobs else None,
            detokenize=detokenize,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def vllm(self, detokenize: bool = False, logprobs: bool = True) -> tuple[int, int]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=q) for q in self.draw()]
        outputs = self.backend.llm.generate(prompts, self.plain_params(detokenize, logprobs), use_tqdm=False)
        return _count([c.token_ids for o in outputs for c in o.outputs])

    def vllm_engine(self, window: int | None = None) -> tuple[int, int]:
        """The draw's requests stepped through ``LLM``'s engine, at most ``window`` in flight (None: all)."""
        from vllm.inputs import TokensPrompt

        params = self.plain_params()
        engine = self.backend.llm.llm_engine
        queue = list(enumerate(self.draw()))
        tokens, in_flight = [], 0
        while queue or engine.has_unfinished_requests():
            while queue and (window is None or in_flight < window):
                i, prompt = queue.pop(0)
                engine.add_request(f"c{self._round}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
                in_flight += 1
            finished = [out for out in engine.step() if out.finished]
            in_flight -= len(finished)
            tokens += [c.token_ids for out in finished for c in out.outputs]
        return _count(tokens)

    def backend_all(self) -> tuple[int, int]:
        groups = self.backend.generate(self.requests(self.draw()), self.params)
        return _count([s.token_ids for _, samples in groups for s in samples])

    def batches(self, evaluate: bool = False) -> tuple[int, int]:
        size = self.config.generator.groups_per_request
        prompts, tokens, done, owed = self.draw(), [], 0, 0.0
        for start in range(0, len(prompts), size):
            for _, samples in self.backend.generate(self.requests(prompts[start : start + size]), self.params):
                tokens += [s.token_ids for s in samples]
            done += size
            owed += size * self.eval_share if evaluate else 0.0
            while owed >= self.config.eval.items_per_request:  # a piece, alone, between batches
                owed -= self.config.eval.items_per_request
                piece = self._eval_prompts(self.config.eval.items_per_request)
                for params in self.eval_runs():
                    list(self.backend.generate(self.requests(piece, "e"), params))
        return _count(tokens)

    def stream(self, evaluate: bool = False) -> tuple[int, int]:
        from generators.base import RequestStream

        stream = RequestStream(self.backend)
        queue, tokens, owed = self.requests(self.draw()), [], 0.0
        training = 0
        while queue or stream:
            while queue and training < self.window:
                stream.add(queue.pop(0), self.params, "train")
                training += 1
                owed += self.eval_share if evaluate else 0.0
            if owed >= self.config.eval.items_per_request:
                owed -= self.config.eval.items_per_request
                piece = self.requests(self._eval_prompts(self.config.eval.items_per_request), "e")
                for params in self.eval_runs():
                    for request in piece:
                        stream.add(request, params, "eval")
            for entry, samples in stream.step():
                if entry.tag == "train":
                    training -= 1
                    tokens += [s.token_ids for s in samples]
        return _count(tokens)

    def _eval_prompts(self, count: int) -> list[list[int]]:
        start = (self._round * count) % max(1, len(self.eval_prompts) - count)
        return self.eval_prompts[start : start + count]

    def run(self, case: str) -> tuple[int, int]:
        return {
            "vllm": self.vllm,
            "vllm-engine": self.vllm_engine,
            "vllm-window": lambda: self.vllm_engine(window=self.window),
            "vllm-nologprobs": lambda: self.vllm(logprobs=False),
            "vllm-detokenize": lambda: self.vllm(detokenize=True),
            "backend": self.backend_all,
            "batches": self.batches,
            "stream": self.stream,
            "stream+eval": lambda: self.stream(evaluate=True),
            "batches+eval": lambda: self.batches(evaluate=True),
        }[case]()


def _count(token_lists: list) -> tuple[int, int]:
    return len(token_lists), sum(len(t) for t in token_lists)


def measure(workload: Workload, cases: list[str], rounds: int) -> dict[str, dict]:
    """Every case once to warm up, then ``rounds`` rounds of the cases in turn (drift falls on all alike)."""
    for case in cases:
        workload.run(case)
    results = {case: {"samples_per_s": [], "tokens_per_s": []} for case in cases}
    for _ in range(rounds):
        for case in cases:
            started = time.perf_counter()
            samples, tokens = workload.run(case)
            took = time.perf_counter() - started
            results[case]["samples_per_s"].append(samples / took)
            results[case]["tokens_per_s"].append(tokens / took)
            print(f"{case}: {samples / took:.1f} samples/s, {tokens / took:.0f} tokens/s ({took:.2f}s)", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--groups", type=int, default=256, help="prompts a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default="bench/results/generator_ceiling.json")
    records.add_argument(parser, "generator_ceiling")
    args, args.overrides = parser.parse_known_args()  # the rest: --key=value overrides, as asyncrl run takes them

    from asyncrl.config import load_config

    config = load_config(args.config, args.overrides)
    workload = Workload(config, args.groups)
    results = measure(workload, args.cases, args.rounds)
    at = stamp(commit=args.commit)
    report = {
        "what": __doc__.split("\n")[0],
        "config": args.config,
        "overrides": args.overrides,
        "groups": args.groups,
        "window": workload.window,
        "eval_prompts_per_group": workload.eval_share,
        "machine": at.machine,
        "date": at.date,
        "commit": at.commit,
        "cases": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    records.write(args.records, records_of(report, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Samples/s of every case but plain vLLM, beside plain vLLM's rounds."""
    cases = report["cases"]
    name = Path(report["config"]).stem + "".join(f" {o}" for o in report["overrides"])
    plain = (
        records.peer("plain vLLM, same engine, no detokenizing", cases["vllm"]["samples_per_s"])
        if "vllm" in cases
        else None
    )
    settings = {"groups": report["groups"], "window": report["window"]}
    return [
        records.measure(
            at,
            bench="generator_ceiling",
            case=f"{name} [{case}]",
            metric="samples_per_s",
            unit="samples/s",
            repeats=result["samples_per_s"],
            vs=plain,
            settings=settings,
        )
        for case, result in cases.items()
        if case != "vllm"
    ]


if __name__ == "__main__":
    sys.exit(main())
