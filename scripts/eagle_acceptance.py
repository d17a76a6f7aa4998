"""Is the EAGLE drafter in decoding as good as its head? Compares, on benchmark prompts:

- decoding: acceptance with `--k 1` (every step drafts one token, from the target's true
  features), greedy;
- teacher forcing: the head's first-token accuracy on the same text (prompt + output) from
  one target pass over it, as `specgen train` measures held-out accuracy; over every output
  position, and over the positions decoding drafted (after an accepted draft the next
  position is the target's own bonus token, never drafted, so decoding samples the harder
  positions more often).

Decoding well below teacher forcing at the drafted positions would mean the drafter reads
other features or positions than the head was trained on.

    python scripts/eagle_acceptance.py --dtype bfloat16 --prompts scripts/prompts/default.jsonl \
        --names py-fib,py-binary-search,chat-email
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from speccli.bench.prompts import load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.heads.train import eagle_first_guesses
from speccli.pipeline import load_pipeline
from speccli.prompts import encode_prompt

REPO = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def teacher_forced_guesses(pipeline, ids: list[int]) -> torch.Tensor:
    """guesses[t]: the head's first drafted token for position t + 2, from the target's
    features of ids[: t + 1] and the token ids[t + 1] (one pass of the target over `ids`)."""
    drafter = pipeline.decoder.drafter
    model = pipeline.target.model
    full = torch.tensor([ids])
    hidden = model.base_model(input_ids=full).last_hidden_state
    head = drafter.head.float()
    try:
        return eagle_first_guesses(head, drafter.embeddings, drafter.rows, drafter.vocab, hidden.float(), full)[0]
    finally:
        drafter.head.to(drafter.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--heads", default="eagle", help="eagle or eagle:PATH")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", default=str(REPO / "scripts" / "prompts" / "default.jsonl"))
    parser.add_argument("--names", default="", help="comma-separated prompt names (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    config = LoadConfig("cpu", args.dtype)
    pipeline = load_pipeline(
        args.target,
        args.heads,
        config,
        LoadConfig("cpu", args.dtype, for_draft=True),
        lambda message: print(message, file=sys.stderr),
    )
    generator = pipeline.speculator()
    names = {n for n in args.names.split(",") if n}
    totals = {"accepted": 0, "drafted": 0, "all": [0, 0], "drafted_positions": [0, 0]}
    print(f"{'prompt':20s} {'decoding k=1':>14s} {'teacher-forced':>15s} {'at drafted positions':>21s}")
    for prompt in load_prompts(Path(args.prompts)):
        if names and prompt.name not in names:
            continue
        request = prompt.request()
        ids = encode_prompt(pipeline.tokenizer, request)
        generation = generator.stream(
            request, SamplingConfig(), SpecConfig(k=1, max_new_tokens=args.max_new_tokens)
        ).run()
        out = generation.token_ids
        if len(out) < 2:
            continue
        guesses = teacher_forced_guesses(pipeline, ids + out)
        first = len(ids) - 2  # guesses[first + i] is the guess for output token i
        every = (guesses[first : first + len(out)] == torch.tensor(out)).float()
        # Each step's first token is the drafted position (the last step may have drafted nothing).
        steps_first = [i for i, token in enumerate(generation.tokens[:-1]) if token.draft_position == 0]
        at_drafted = every[torch.tensor(steps_first, dtype=torch.long)]
        stats = generation.stats
        print(
            f"{prompt.name:20s} {stats.accepted:>5d}/{stats.drafted:<4d}{stats.accepted / max(1, stats.drafted):5.2f}"
            f" {every.mean():15.2f} {at_drafted.mean():21.2f}"
        )
        totals["accepted"] += stats.accepted
        totals["drafted"] += stats.drafted
        totals["all"][0] += float(every.sum())
        totals["all"][1] += len(every)
        totals["drafted_positions"][0] += float(at_drafted.sum())
        totals["drafted_positions"][1] += len(at_drafted)
    if totals["drafted"]:
        print(
            f"{'all':20s} {totals['accepted'] / totals['drafted']:14.3f} {totals['all'][0] / totals['all'][1]:15.3f}"
            f" {totals['drafted_positions'][0] / totals['drafted_positions'][1]:21.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
