"""How often a pass over several tokens and passes over one disagree on the target's argmax.

    python scripts/argmax_flips.py --dtype bfloat16 --prompts scripts/prompts/default.jsonl

For each prompt the target decodes greedily (plain, one token a pass); then, with the
output layer's top logits in float32 (speccli.models.kernels.precise_logits) and without, the same
text is scored again one token a pass and in passes of W tokens (as a verification of W - 1
drafts feeds them), and every position where the two argmaxes differ is counted: a place
where speculative and plain decoding could part (a near-tie). In float32 there should be
none. Prints the counts per prompt and in all, and the one-token passes' top-two gap at
each flip.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from speccli.bench.prompts import encode_bench_prompt, load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.models.kernels.cpu import cpu_name
from speccli.models.kernels.precise_logits import set_precise_logits
from speccli.pipeline import load_pipeline

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "default.jsonl"


def argmaxes_one_by_one(lm, prompt: list[int], text: list[int]) -> tuple[list[int], list[float]]:
    """The argmax after each of prompt + text[:-1] fed one token a pass, and its top-two gap."""
    lm.rollback(0)
    lm.forward(prompt[:-1], all_logits=False)
    picks, gaps = [], []
    for token in [prompt[-1], *text[:-1]]:
        top = lm.forward([token])[-1].topk(2)
        picks.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
    return picks, gaps


def argmaxes_in_windows(lm, prompt: list[int], text: list[int], width: int) -> list[int]:
    """The same argmaxes, the tokens fed `width` a pass."""
    lm.rollback(0)
    lm.forward(prompt[:-1], all_logits=False)
    fed = [prompt[-1], *text[:-1]]
    picks: list[int] = []
    for start in range(0, len(fed), width):
        picks += torch.argmax(lm.forward(fed[start : start + width]), dim=-1).tolist()
    return picks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=Path, nargs="+", default=[DEFAULT_PROMPTS])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--widths", default="5,17", help="comma-separated pass widths")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    config = LoadConfig(dtype=args.dtype)
    pipeline = load_pipeline(args.target, "none", config, config, progress=log)
    model, lm = pipeline.target.model, pipeline.decoder.target
    refined = set_precise_logits(model)
    modes = (True, False) if refined else (False,)
    speculator = pipeline.speculator(log)
    prompts = [p for path in args.prompts for p in load_prompts(path)]
    print(
        f"CPU: {cpu_name()}; target {args.target} in {args.dtype}; flips = positions where a pass over W tokens"
        f" and one-token passes pick different argmaxes, over each prompt's plain greedy text"
    )
    totals = {(precise, w): 0 for precise in modes for w in widths}
    positions = 0
    rows = []
    for prompt in prompts:
        ids = encode_bench_prompt(pipeline.tokenizer, prompt)
        set_precise_logits(model, refined)
        text = (
            speculator.stream(
                ids, SamplingConfig(), SpecConfig(k=0, max_new_tokens=args.max_new_tokens), plain=True, cold=True
            )
            .run()
            .token_ids
        )
        if not text:
            continue
        positions += len(text)
        row = {"prompt": prompt.name, "tokens": len(text), "flips": {}}
        for precise in modes:
            set_precise_logits(model, precise)
            one, gaps = argmaxes_one_by_one(lm, ids, text)
            for w in widths:
                windowed = argmaxes_in_windows(lm, ids, text, w)
                flips = [i for i, (a, b) in enumerate(zip(one, windowed)) if a != b]
                totals[(precise, w)] += len(flips)
                key = f"{'precise' if precise else args.dtype}/W{w}"
                row["flips"][key] = [{"position": i, "gap": round(gaps[i], 4)} for i in flips]
        rows.append(row)
        cells = ", ".join(f"{k} {len(v)}" for k, v in row["flips"].items())
        print(f"{prompt.name:<24} {len(text):>3} tokens: {cells}", flush=True)
    print(f"in all, {positions} positions over {len(rows)} prompts:")
    for (precise, w), count in totals.items():
        print(f"  {'top logits in float32' if precise else args.dtype + ' logits':<22} W {w:>2}: {count} flips")
    if args.json_out:
        payload = {
            "cpu": cpu_name(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "positions": positions,
            "totals": {f"{'precise' if p else args.dtype}/W{w}": c for (p, w), c in totals.items()},
            "rows": rows,
        }
        args.json_out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
