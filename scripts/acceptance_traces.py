"""What the real offline pair accepts, recorded once on the CPU, to project tokens/s on a GPU.

Random weights of real shapes give a GPU's pass costs but not a real draft's acceptance. The
acceptance of greedy drafting is a property of the two models' outputs, not of the machine:
while the draft's tokens match the target's, the draft reads the target's own text, so the
chain it drafts from position i is its teacher-forced choice at i, i+1, ... up to the first
mismatch. So one teacher-forced pass of the draft over each of the target's greedy answers
(benchmark.py's hf-plain tokens, float32) records, for every position, whether the draft
picks the target's token there ("matches"), and from the matches any draft length replays:

    python scripts/acceptance_traces.py benchmarks/results/benchmark-2026-12-05-amx-float32-lookahead-trees.json \
        --out scripts/data/acceptance-traces-qwen2.5-coder-float32.json

`project()` replays them against a pass-cost curve (scripts/gpu_check.py measures the same
shapes' curve on a GPU): per step k draft tokens, one verification of k + 1, and the tokens
the matches accept plus one; fixed k from 1 to 8, and the best of them (what k auto aims at).
The result is a projection, not a measurement: no loop overhead, no early stop on an unsure
draft token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

KS = tuple(range(1, 9))


def matches_of(draft, prompt: list[int], answer: list[int]) -> list[bool]:
    """Per answer position, whether the draft's teacher-forced greedy choice is the answer's token."""
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return (logits.argmax(-1) == torch.tensor(answer)).tolist()


def accepted_runs(matches: list[bool]) -> list[int]:
    """For each position, how many consecutive matches start there."""
    runs = [0] * (len(matches) + 1)
    for i in range(len(matches) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if matches[i] else 0
    return runs[:-1]


def replay_steps(matches: list[bool], k: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of each step of fixed-k greedy drafting over one answer."""
    runs, steps, position = accepted_runs(matches), [], 0
    while position < len(matches):
        drafted = min(k, len(matches) - position - 1)  # nothing is drafted past the answer's end
        accepted = min(drafted, runs[position])
        steps.append((drafted, accepted))
        position += accepted + 1
    return steps


def cost_at(verify_ms: dict[int, float], fed: int) -> float:
    """A pass's cost: the measured size, else the next larger one measured."""
    sizes = sorted(verify_ms)
    return verify_ms[next((s for s in sizes if s >= fed), sizes[-1])]


def project(traces: list[list[bool]], verify_ms: dict[int, float], draft_ms: float) -> dict:
    """Projected tokens/s of plain decoding and of fixed-k drafting over all traces at these
    costs (milliseconds of a target pass by tokens fed; of one draft token)."""
    tokens = sum(len(t) for t in traces)
    plain_s = tokens * cost_at(verify_ms, 1) / 1e3
    result = {"tokens": tokens, "plain_tokens_per_s": round(tokens / plain_s, 1), "k": {}}
    for k in KS:
        seconds, accepted, drafted = 0.0, 0, 0
        for trace in traces:
            for d, a in replay_steps(trace, k):
                seconds += (d * draft_ms + cost_at(verify_ms, d + 1)) / 1e3
                drafted, accepted = drafted + d, accepted + a
        result["k"][k] = {
            "tokens_per_s": round(tokens / seconds, 1),
            "speedup": round(plain_s / seconds, 3),
            "acceptance": round(accepted / max(1, drafted), 3),
        }
    best = max(result["k"], key=lambda k: result["k"][k]["tokens_per_s"])
    result["best_k"] = best
    result["best_speedup"] = result["k"][best]["speedup"]
    return result


def record(benchmark: Path, draft_name: str | None) -> dict:
    from speccli.bench.prompts import encode_bench_prompt, load_prompts
    from speccli.config import LoadConfig
    from speccli.models.loading import load_model

    data = json.loads(benchmark.read_text())
    result = next(r for r in data["dtypes"] if r["dtype"] == "float32")
    draft = load_model(
        draft_name or data["draft"], LoadConfig(device="cpu", dtype="float32", quant="none", cpu_linear="stock")
    )
    prompts_file = Path(data["prompts_file"])
    if not prompts_file.exists():  # written on another machine: this checkout's copy
        prompts_file = Path(__file__).parent / "prompts" / prompts_file.name
    prompts = {p.name: p for p in load_prompts(prompts_file)}
    rows = []
    for row in result["rows"]:
        prompt = encode_bench_prompt(draft.tokenizer, prompts[row["prompt"]])
        answer = row["methods"]["hf-plain"]["tokens"]
        matches = matches_of(draft.model, prompt, answer)
        rows.append(
            {"prompt": row["prompt"], "tokens": len(answer), "matches": "".join("1" if m else "0" for m in matches)}
        )
        print(f"acceptance_traces: {row['prompt']}: {sum(matches)}/{len(matches)} positions match", file=sys.stderr)
    return {
        "target": data["target"],
        "draft": draft_name or data["draft"],
        "dtype": "float32",
        "source": benchmark.name,
        "rows": rows,
    }


def load_traces(path: Path) -> list[list[bool]]:
    return [[c == "1" for c in row["matches"]] for row in json.loads(path.read_text())["rows"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", type=Path, help="a benchmark.py JSON with float32 hf-plain answers")
    parser.add_argument("--draft", default=None, help="the draft (default: the benchmark's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    traces = record(args.benchmark, args.draft)
    args.out.write_text(json.dumps(traces, indent=1) + "\n")
    matched = sum(r["matches"].count("1") for r in traces["rows"])
    total = sum(r["tokens"] for r in traces["rows"])
    print(f"acceptance_traces: {len(traces['rows'])} prompts, {matched}/{total} positions match; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
