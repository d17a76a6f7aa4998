"""Plot scripts/benchmark.py JSON results: tokens/s per prompt and method, one panel per dtype
and result file (each panel shows the methods its run measured).

    python scripts/plot_benchmark.py bench.json benchmark.png
    python scripts/plot_benchmark.py bench-bf16.json bench-f32.json benchmark.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(result, run) for result in results for run in result["dtypes"]]
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 4.2 * len(runs)), squeeze=False)
    for ax, (result, run) in zip(axes[:, 0], runs):
        methods = list(run["median_tokens_per_second"])
        width = 0.8 / len(methods)
        prompts = [row["prompt"] for row in run["rows"]] + ["median"]
        for i, method in enumerate(methods):
            values = [row["methods"][method]["tokens_per_second"] for row in run["rows"]]
            values.append(run["median_tokens_per_second"][method])
            positions = [p + (i - (len(methods) - 1) / 2) * width for p in range(len(prompts))]
            ax.bar(positions, values, width, label=method)
        ax.set_xticks(range(len(prompts)))
        ax.set_xticklabels(prompts, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (prefill included)")
        plain = run["median_tokens_per_second"]["hf-plain"]
        ax.axhline(plain, color="grey", linewidth=0.8, linestyle="--")
        kernels = ", specgen's float32 linear layers on oneDNN" if "oneDNN" in run.get("specgen_target", "") else ""
        ax.set_title(
            f"{run['dtype']}: {result['target']} target, {result['draft']} draft, greedy,"
            f" {result['max_new_tokens']} new tokens, {result['date'][:16]}{kernels}"
            " (dashed: median of hf-plain)",
            fontsize=10,
        )
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
        ax.legend(fontsize=8, ncol=len(methods), loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="JSON written by scripts/benchmark.py --json-out")
    parser.add_argument("out", type=Path, help="PNG to write")
    args = parser.parse_args()
    plot([json.loads(path.read_text()) for path in args.results], args.out)


if __name__ == "__main__":
    main()
