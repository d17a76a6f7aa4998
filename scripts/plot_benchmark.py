"""Plot a scripts/benchmark.py JSON result: tokens/s per prompt and method, one panel per dtype.

    python scripts/plot_benchmark.py bench.json docs/benchmark.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["dtypes"]
    methods = result["methods"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 4.2 * len(runs)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, run in zip(axes[:, 0], runs):
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
        ax.set_title(f"{run['dtype']}: {result['target']} target, {result['draft']} draft, greedy,"
                     f" {result['max_new_tokens']} new tokens (dashed: median of hf-plain)")
        ax.legend(fontsize=8, ncol=len(methods))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="JSON written by scripts/benchmark.py --json-out")
    parser.add_argument("out", type=Path, help="PNG to write")
    args = parser.parse_args()
    plot(json.loads(args.result.read_text()), args.out)


if __name__ == "__main__":
    main()
