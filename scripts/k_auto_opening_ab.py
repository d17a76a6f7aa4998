"""A/B: k auto with a generation's opening step learned apart (auto, the current code) against
one acceptance for every step (auto-old: AdaptiveDraftLength.begin made a no-op, which is the
code before the change), with plain decoding beside them; the real Qwen2.5-Coder pair, one
calibration, one process, the variants' order rotated per prompt (modelled + measured).

    python scripts/k_auto_opening_ab.py float32 plain,auto-old,auto 12 128 out.json

ONESHOT=1: a fresh policy for every prompt, as `specgen generate` runs (each from the learned
prior PRIOR, comma-separated acceptance by position, worth PRIOR_STEPS steps); without it one
policy per variant across the prompts, as a chat session or `specgen bench` runs."""

import json
import os
import statistics
import sys
import time
from importlib import util
from pathlib import Path

import torch

from speccli.api import Speculator
from speccli.autok import policy as pol
from speccli.autok.costs import CostCurve, measure_costs
from speccli.bench.prompts import encode_bench_prompt, load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.models.loading import load_model
from speccli.pipeline import causal_lm, model_drafter

dtype, variants, limit, max_new, out = (
    sys.argv[1],
    sys.argv[2].split(","),
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
)
oneshot = os.environ.get("ONESHOT") == "1"
prior = None
if os.environ.get("PRIOR"):
    prior = pol.AcceptancePrior(
        tuple(float(a) for a in os.environ["PRIOR"].split(",")), float(os.environ.get("PRIOR_STEPS", "200"))
    )
target = load_model("qwen2.5-coder-1.5b", LoadConfig(device="cpu", dtype=dtype), progress=lambda m: None)
lm = causal_lm(target, "auto")
eos = list(target.eos_token_ids)
draft = load_model("qwen2.5-coder-0.5b", LoadConfig(device="cpu", dtype=dtype, for_draft=True), progress=lambda m: None)
drafter = model_drafter(lm, target.tokenizer, draft, cuda_graphs="auto")
costs = measure_costs(lm, drafter.model, 17)
cal = costs.verify_seconds
print(
    "calibration",
    {k: round(v / cal[1], 2) for k, v in sorted(cal.items())},
    f"one token {1000 * cal[1]:.0f} ms,",
    f"draft token {1000 * costs.draft_seconds:.0f} ms",
    flush=True,
)
profile = CostCurve(cal, None)
new_begin = pol.AdaptiveDraftLength.begin


def generator() -> Speculator:
    g = Speculator.over(lm, target.tokenizer, eos, drafter, costs)
    g.decoder.prior = prior
    return g


session = {v: generator() for v in variants}

spec = util.spec_from_file_location("bm", "scripts/benchmark.py")
bm = util.module_from_spec(spec)
spec.loader.exec_module(bm)
prompts = bm.round_robin_by_category(load_prompts(Path("scripts/prompts/default.jsonl")), limit)
rows = []
for i, p in enumerate(prompts):
    ids = encode_bench_prompt(target.tokenizer, p)
    row = {"prompt": p.name}
    for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
        pol.AdaptiveDraftLength.begin = (lambda self: None) if v.endswith("-old") else new_begin
        g = generator() if oneshot else session[v]
        t0 = time.perf_counter()
        with torch.inference_mode():
            r = g.stream(
                ids, SamplingConfig(), SpecConfig(k=0 if v == "plain" else "auto", max_new_tokens=max_new), cold=True
            ).run()
        wall = time.perf_counter() - t0
        lm.rollback(0)
        drafter.model.rollback(0)
        s = r.stats
        passes = dict(s.passes)
        row[v] = {
            "tokens": r.token_ids,
            "n": len(r.token_ids),
            "wall": wall,
            "steps": s.steps,
            "drafted": s.drafted,
            "modelled": profile.modelled_seconds(passes) + s.drafted * costs.draft_seconds,
            "passes": {str(f): c for f, c in sorted(passes.items())},
        }
    pol.AdaptiveDraftLength.begin = new_begin
    base = row["plain"]
    print(
        f"{p.name[:18]:18}"
        + "".join(
            f" {v}: {r['n'] / r['modelled']:.2f}m {r['n'] / r['wall']:.2f}w st{r['steps']}"
            f"{'' if r['tokens'] == base['tokens'] else '*'}"
            for v in variants
            for r in [row[v]]
        ),
        flush=True,
    )
    rows.append(row)


def ratios(a, b):
    m = [r[a]["n"] / r[a]["modelled"] / (r[b]["n"] / r[b]["modelled"]) for r in rows]
    w = [r[a]["n"] / r[a]["wall"] / (r[b]["n"] / r[b]["wall"]) for r in rows]
    return {
        "modelled_median": statistics.median(m),
        "modelled_geomean": statistics.geometric_mean(m),
        "modelled_lowest": min(m),
        "measured_median": statistics.median(w),
        "measured_geomean": statistics.geometric_mean(w),
        "measured_lowest": min(w),
    }


pairs = [
    (a, b)
    for a, b in [("auto", "auto-old"), ("auto", "plain"), ("auto-old", "plain")]
    if a in variants and b in variants
]
summary = {f"{a} / {b}": ratios(a, b) for a, b in pairs}
medians = {v: statistics.median(r[v]["n"] / r[v]["wall"] for r in rows) for v in variants}
print("median tokens/s", {v: round(t, 2) for v, t in medians.items()})
for name, r in summary.items():
    print(
        f"{name:18} modelled median {r['modelled_median']:.3f} geomean {r['modelled_geomean']:.3f}"
        f" lowest {r['modelled_lowest']:.3f}"
        f" | measured median {r['measured_median']:.3f} geomean {r['measured_geomean']:.3f}"
        f" lowest {r['measured_lowest']:.3f}"
    )
Path(out).write_text(
    json.dumps(
        {
            "dtype": dtype,
            "oneshot": oneshot,
            "prior": prior and [list(prior.acceptance), prior.steps],
            "calibration": {str(k): v for k, v in cal.items()},
            "draft_seconds": costs.draft_seconds,
            "median_tokens_per_second": medians,
            "summary": summary,
            "rows": rows,
            "script": Path(__file__).read_text(),
        },
        indent=1,
    )
)
