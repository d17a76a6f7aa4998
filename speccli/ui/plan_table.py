"""`specgen plan`: the memory a pair needs per GPU, as a table for people or JSON for scripts."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from speccli.models.memory.plan import GB, MemoryNeed, PairPlan


def _need(need: MemoryNeed | None) -> dict | None:
    if need is None:
        return None
    return {
        "weights": round(need.weights),
        "kv_cache": round(need.kv_cache),
        "working": round(need.working),
        "total": round(need.total),
    }


def plan_dict(plan: PairPlan) -> dict:
    return {
        "target": plan.target,
        "draft": plan.draft,
        "quant": plan.quant,
        "draft_quant": plan.draft_quant,
        "tp": plan.tp,
        "kv_tokens": plan.kv_tokens,
        "target_weights": round(plan.target_weights),
        "target_per_gpu": _need(plan.target_need),
        "draft_on_first_gpu": _need(plan.draft_need),
        "first_gpu": round(plan.first_gpu),
        "gpu_bytes": None if plan.gpu_bytes is None else round(plan.gpu_bytes),
        "gpus": plan.gpus,
        "fits": plan.fits,
        "suggestions": list(plan.suggestions),
        "verdict": plan.verdict(),
    }


def print_json(plan: PairPlan, stream: TextIO | None = None) -> None:
    print(json.dumps(plan_dict(plan), indent=2), file=stream or sys.stdout)


def print_table(plan: PairPlan, stream: TextIO | None = None) -> None:
    from rich.table import Table

    from speccli.ui.consoles import PipeAwareConsole

    def gb(value: float) -> str:
        return f"{value / GB:.1f} GB"

    table = Table(
        title=f"specgen plan: tensor parallel over {plan.tp} GPU(s), KV cache for {plan.kv_tokens:,} tokens",
        title_justify="left",
    )
    for column in ("model", "format", "on", "weights", "KV cache", "working", "total"):
        table.add_column(column, no_wrap=True, justify="left" if column in ("model", "format", "on") else "right")
    spread = "each GPU" if plan.tp > 1 else "the GPU"
    rows = [(f"target {plan.target}", plan.quant, spread, plan.target_need)]
    if plan.draft_need is not None:
        rows.append((f"draft {plan.draft}", plan.draft_quant, "the first GPU", plan.draft_need))
    for label, fmt, where, need in rows:
        table.add_row(label, fmt, where, gb(need.weights), gb(need.kv_cache), gb(need.working), gb(need.total))
    stream = stream or sys.stdout
    console = PipeAwareConsole(file=stream, width=None if stream.isatty() else 200)
    console.print(table)
    if plan.gpu_bytes is None:
        memory = "not known"
    else:
        memory = f"{gb(plan.gpu_bytes)} per GPU" + (f", {plan.gpus} GPU(s) here" if plan.gpus else "")
    console.print(f"GPU memory: {memory}.\nVerdict: {plan.verdict()}.", highlight=False)
