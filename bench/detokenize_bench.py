"""The vLLM generator's sampling loop with the engine detokenizing every token against decoding each sample once.

The backend asks vLLM to detokenize only when stop strings need it, and
otherwise decodes each sample when its group is done. This runs the backend's
own ``generate`` both ways on one engine, alternating rounds (the other way is
forced by passing ``detokenize=True`` into vLLM's ``SamplingParams``), and
reports sampled tokens per second, the backend's decoding included. The gain
is largest where the engine loop's Python work, not the model, sets the pace:
small models, large batches, a fast GPU.

    python bench/detokenize_bench.py --model assets/tiny-llama --out bench/results/detokenize_cpu.json

Also appends the rounds after the first, both ways side by side, to
``bench/records/detokenize_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.provenance import head_commit, machine, stamp, versions_of  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "assets/tiny-llama"), help="HF folder")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7, help="of each way, alternating; the first warms up")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    records.add_argument(parser, "detokenize_bench")
    args = parser.parse_args(argv)

    import torch
    import vllm

    from generators.base import GenerationRequest, SamplingParams
    from generators.vllm_backend import VllmBackend

    engine_params = vllm.SamplingParams

    def forced(*positional, **keywords):  # the engine detokenizes, as before the backend decoded itself
        keywords["detokenize"] = True
        return engine_params(*positional, **keywords)

    backend = VllmBackend(args.model, max_model_len=args.max_model_len)
    tokenizer = backend.tokenizer
    requests = [
        GenerationRequest(f"q{i}", tokenizer.encode(f"{i % 10}{(i * 7) % 10}{(i * 3) % 10}="))
        for i in range(args.prompts)
    ]
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0)
    rows = []
    for round_ in range(args.rounds):
        for engine_detokenizes in (True, False):
            vllm.SamplingParams = forced if engine_detokenizes else engine_params
            try:
                started, tokens = time.monotonic(), 0
                for _, samples in backend.generate(requests, params):
                    tokens += sum(len(s.token_ids) for s in samples)
                seconds = time.monotonic() - started
            finally:
                vllm.SamplingParams = engine_params
            rows.append(
                {
                    "round": round_,
                    "engine_detokenizes": engine_detokenizes,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                }
            )
            print(
                f"round {round_}, engine detokenizes={engine_detokenizes}: {tokens / seconds:,.0f} tokens/s", flush=True
            )
    backend.close()

    def median(engine_detokenizes: bool) -> float:
        return statistics.median(
            r["tokens_per_s"] for r in rows if r["engine_detokenizes"] == engine_detokenizes and r["round"] > 0
        )

    report = {
        "benchmark": "vLLM generator tokens/s: the engine detokenizing every token against the backend decoding "
        "each finished sample once",
        "date": datetime.date.today().isoformat(),
        "machine": machine(torch.cuda.is_available()),
        "versions_of": versions_of(),
        "commit": head_commit(),
        "command": " ".join(["python", "bench/detokenize_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "prompts": args.prompts,
        "n": args.n,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "runs": rows,
        "tokens_per_s_median": {"engine_detokenizes": median(True), "decoded_after": median(False)},
    }
    report["ratio_decoded_after_over_engine"] = (
        report["tokens_per_s_median"]["decoded_after"] / report["tokens_per_s_median"]["engine_detokenizes"]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"decoding each sample once: {report['ratio_decoded_after_over_engine']:.2f}x the tokens/s "
        f"(medians after the first round); wrote {args.out}",
        flush=True,
    )
    records.write(args.records, records_of(report, stamp()))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Tokens/s decoding each sample once, beside the engine detokenizing every token (rounds after the first)."""

    def rounds(engine_detokenizes: bool) -> list[float]:
        return [
            r["tokens_per_s"] for r in report["runs"] if r["engine_detokenizes"] is engine_detokenizes and r["round"]
        ]

    settings = {key: report[key] for key in ("prompts", "n", "new_tokens", "rounds")}
    return [
        records.measure(
            at,
            bench="detokenize_bench",
            case=Path(report["model"]).name,
            metric="tokens_per_s",
            unit="tokens/s",
            repeats=rounds(False),
            vs=records.peer("engine detokenizing", rounds(True)),
            settings=settings,
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
