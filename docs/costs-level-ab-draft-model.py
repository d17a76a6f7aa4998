"""A/B: k auto's online costs as one level on the calibrated curve (new) against each size's
own moving average (old), for --draft ngram and lookahead, with plain decoding beside them;
one calibration, one process, the variants' order rotated per prompt (modelled + measured)."""
import json, statistics, sys, time
from pathlib import Path
import torch
from speccli.commands.bench_prompts import encode_bench_prompt, load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.engine.calibration import CostProfile, measure_costs
from speccli.engine.drafters import PromptLookupDrafter
from speccli.engine.lookahead import LookaheadDrafter
from speccli.engine import policy as pol
from speccli.generation.pipeline import causal_lm, model_drafter
from dataclasses import replace
from speccli.generation.stream import Generator
from speccli.models.loading import load_model

dtype = sys.argv[1]; variants = sys.argv[2].split(","); limit = int(sys.argv[3]); out = sys.argv[4]
target = load_model("qwen2.5-coder-1.5b", LoadConfig(device="cpu", dtype=dtype), progress=lambda m: None)
lm = causal_lm(target, "auto")
eos = list(target.eos_token_ids)
spec_draft = load_model("qwen2.5-coder-0.5b", LoadConfig(device="cpu", dtype=dtype, for_draft=True), progress=lambda m: None)
drafter = model_drafter(lm, target.tokenizer, spec_draft, cuda_graphs="auto")
costs = measure_costs(lm, drafter.model, 17)
cal = costs.verify_seconds
print("cal", {k: round(v / cal[1], 2) for k, v in sorted(cal.items())}, f"one {1000*cal[1]:.0f} ms", flush=True)
profile = CostProfile(cal, None)
full = CostProfile(cal, costs.draft_seconds)
print("draft token", costs.draft_seconds)
new_observe = pol.StepCosts.observe

def old_observe(self, step):  # each size its own moving average (before this change)
    fed = step.fed
    if fed in self._calibrated and fed not in self._counts:
        self._counts[fed] = self._weight  # the old seed: each calibrated size worth 3 measurements
    self.verify[fed] = self._blend(fed, self.verify.get(fed), step.verify_seconds)
    if step.drafted:
        self.draft_per_token = self._blend("draft", self.draft_per_token, (step.draft_seconds - step.catch_up_seconds) / step.drafted)

gens = {v: Generator.over(lm, target.tokenizer, eos, drafter, full) for v in variants}
prompts = load_prompts(Path("scripts/prompts/default.jsonl"))
from importlib import util
spec = util.spec_from_file_location("bm", "scripts/benchmark.py"); bm = util.module_from_spec(spec); spec.loader.exec_module(bm)
prompts = bm.round_robin_by_category(prompts, limit)
rows = []
for i, p in enumerate(prompts):
    ids = encode_bench_prompt(target.tokenizer, p)
    row = {"prompt": p.name}
    order = variants[i % len(variants):] + variants[:i % len(variants)]
    for v in order:
        pol.StepCosts.observe = old_observe if v.endswith("-old") else new_observe
        k = 0 if v == "plain" else "auto"
        t0 = time.perf_counter()
        with torch.inference_mode():
            g = gens[v].stream(ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=128), cold=True).run()
        wall = time.perf_counter() - t0
        lm.rollback(0); drafter.model.rollback(0)
        s = g.stats
        passes = dict(s.passes)
        row[v] = {"tokens": g.token_ids, "n": len(g.token_ids), "wall": wall, "modelled": profile.modelled_seconds(passes) + s.drafted * costs.draft_seconds, "drafted": s.drafted,
                  "passes": {str(f): c for f, c in sorted(passes.items())}, "steps": s.steps}
    pol.StepCosts.observe = new_observe
    base = row["plain"]
    print(f"{p.name[:18]:18}" + "".join(
        f" {v}: {r['n']/r['modelled']:.2f}m {r['n']/r['wall']:.2f}w st{r['steps']}{'' if r['tokens'] == base['tokens'] else '*'}"
        for v in variants for r in [row[v]]), flush=True)
    rows.append(row)

def ratios(a, b):
    m = [r[a]["n"] / r[a]["modelled"] / (r[b]["n"] / r[b]["modelled"]) for r in rows]
    w = [r[a]["n"] / r[a]["wall"] / (r[b]["n"] / r[b]["wall"]) for r in rows]
    return {"modelled_median": statistics.median(m), "modelled_lowest": min(m), "measured_median": statistics.median(w), "measured_lowest": min(w)}

pairs = [(a, b) for a, b in [("draft", "draft-old"), ("draft", "plain"), ("draft-old", "plain"), ("ngram", "ngram-old"), ("la", "la-old"), ("ngram", "plain"), ("ngram-old", "plain"),
                              ("la", "plain"), ("la-old", "plain"), ("la", "ngram"), ("la-old", "ngram-old")] if a in variants and b in variants]
summary = {f"{a} / {b}": ratios(a, b) for a, b in pairs}
for name, r in summary.items():
    print(f"{name:22} modelled median {r['modelled_median']:.3f} lowest {r['modelled_lowest']:.3f} | measured median {r['measured_median']:.3f} lowest {r['measured_lowest']:.3f}")
Path(out).write_text(json.dumps({"dtype": dtype, "calibration": {str(k): v for k, v in cal.items()}, "summary": summary, "rows": rows,
                                 "script": Path(__file__).read_text()}, indent=1))
