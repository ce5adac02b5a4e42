"""Greedy tokens, ours against llama.cpp on the same GGUF file, ids and threads: do both run the
same model?

Each of --prompts windows of --context tokens (from the same text engine_bench reads, at spread
offsets) is continued greedily for --tokens tokens on both sides. Two engines with different
float summation orders cannot agree everywhere: where the model's top two choices are nearly
tied, either may win. So at each prompt's first difference this reports our log-probability gap
between our token and llama.cpp's (None when theirs is not in our top --top-k): a gap under
--near-tie nats is a near tie, anything else a real disagreement. After the first difference the
two continue from different text, so only the tokens before it count as agreement.

Ours runs as the service does (EngineConfig defaults; --int8-activations true/false/auto); the
peer is llama-cpp-python from bench/setup_peers.sh's venv (flash attention off, its faster
setting on this host's engine_bench probe).

Writes bench/results/greedy_agreement.json (--out) and prints one line per prompt.

    python -m bench.greedy_agreement [--model bench/.cache/qwen/<file>.gguf]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.engine_bench import NOT_INSTALLED, RESULTS, ROOT, LlamaCpp, corpus_ids, pin_threads
from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.sampling.params import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare_prompt(ours: list[int], theirs: list[int], logprobs: list, near_tie: float) -> dict:
    """One prompt's verdict: where the two part, and how close our model found that choice."""
    part = first_difference(ours, theirs)
    row: dict = {"tokens": len(ours), "first_difference": part, "gap_nats": None}
    if part is None:
        row["verdict"] = "identical"
        return row
    top = dict(logprobs[part].top)
    theirs_lp = top.get(theirs[part])
    if theirs_lp is not None:
        row["gap_nats"] = logprobs[part].logprob - theirs_lp
    row["theirs_is_our_second"] = len(logprobs[part].top) > 1 and (
        logprobs[part].top[1][0] == theirs[part]
    )
    tie = row["gap_nats"] is not None and row["gap_nats"] < near_tie
    row["verdict"] = "near tie" if tie else "DISAGREE"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the packaged model)")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--near-tie", type=float, default=0.1, help="nats")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--int8-activations", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    parser.add_argument("--out", type=Path, default=RESULTS / "greedy_agreement.json")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = args.model or packaged_llm_path()
    q8 = {"auto": "auto", "true": True, "false": False}[args.int8_activations]
    engine = LLMEngine(EngineConfig(model=str(model), int8_activations=q8))
    python = args.peers_venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"llama.cpp: {NOT_INSTALLED}")
    n_ctx = -(-(args.context + args.tokens + 64) // 256) * 256
    peer = LlamaCpp(python, str(model), args.threads, n_ctx, "off")
    params = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=args.top_k
    )
    rows = []
    try:
        for i in range(args.prompts):
            ids = corpus_ids(engine, args.context, offset=200 + 700 * i)
            ours = engine.generate([ids], params)[0]
            _, theirs = peer.decode(ids, args.tokens)
            row = compare_prompt(ours.token_ids, theirs, ours.logprobs, args.near_tie)
            rows.append(row)
            gap = "" if row["gap_nats"] is None else f", gap {row['gap_nats']:.4f} nats"
            print(f"prompt {i}: {row['verdict']} (first difference {row['first_difference']}{gap})")
    finally:
        peer.close()
    total = sum(r["tokens"] for r in rows)
    before = sum(
        r["tokens"] if r["first_difference"] is None else r["first_difference"] for r in rows
    )
    result = {
        "model": Path(model).name,
        "ours": {
            "int8_activations": engine.runner.int8_activations,
            "weight_quant": engine.runner.weight_quant,
            "kv_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
        },
        "peer": peer.info,
        "sizes": {"prompts": args.prompts, "tokens": args.tokens, "context": args.context},
        "near_tie_nats": args.near_tie,
        "prompts": rows,
        "before_first_difference_fraction": before / total,
        "every_difference_a_near_tie": all(r["verdict"] != "DISAGREE" for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{before}/{total} tokens before the first difference; every difference a near tie: "
        f"{result['every_difference_a_near_tie']}; wrote {args.out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
