"""What one target pass costs by the number of tokens fed, on this machine: the curve that
decides how long drafts, how wide trees and how large lookahead windows pay.

    python scripts/pass_costs.py --model qwen2.5-coder-1.5b --dtypes bfloat16,float32 \
        --sizes 1,2,3,4,6,8,12,16,17,24,32,48,64

Each size is timed on top of 64 cached tokens, right after a one-token pass, in --repeats
rounds (each round over every size in turn, the other way round each time, after a warm-up
round): its median ratio to that pass times the fastest one-token pass, as specgen's
calibration does. Prints one
table row per dtype in milliseconds and as a multiple of a one-token pass; --json-out keeps
the figures with the CPU and library versions.

With --compare-stock, where specgen switched the model's linear layers to its own CPU
kernels (oneDNN for float32, one-row products as two rows for bfloat16), the curve is
timed again with PyTorch's stock kernels, and one-token passes under the two are timed in
adjacent pairs (--repeats x 3 of them, the order alternating): their median ratio. Where
float32 keeps PyTorch's kernel for the fewest rows (the load line's `oneDNN linear from N
rows`), every size is also timed under the three choices side by side (specgen's, oneDNN's
for all rows, PyTorch's for all rows; adjacent, the order alternating, medians of --repeats).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from speccli.autok.costs import CONTEXT_TOKENS, filler_ids, measure_costs
from speccli.config import LoadConfig
from speccli.models.loading import cpu_name, load_model
from speccli.models.kernels.onednn import OneDnnLinear, alternating_pairs, set_cpu_linear, set_onednn_linear
from speccli.pipeline import backend_label, causal_lm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--sizes",
        default="1,2,3,4,6,8,12,16,17,24,32,48,64",
        help="comma-separated numbers of tokens fed (1 is always timed: the ratios need it)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compare-stock",
        action="store_true",
        help="also time the curve, and one-token passes in pairs, with PyTorch's stock linear kernels",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    try:
        sizes = sorted({1, *(int(s) for s in args.sizes.split(",") if s.strip())})
    except ValueError:
        parser.error(f"--sizes takes whole numbers separated by commas, got {args.sizes!r}")
    if sizes[0] < 1:
        parser.error("--sizes must be 1 or more")

    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}", file=sys.stderr)
    results = []
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        loaded = load_model(
            args.model,
            LoadConfig(device=args.device, dtype=dtype),
            progress=lambda message: print(message, file=sys.stderr),
        )
        lm = causal_lm(loaded)
        costs = measure_costs(lm, None, max(sizes), repeats=args.repeats, sizes=sizes)
        print(f"\n{loaded.describe()} [{backend_label(lm)}]")
        print_curve(sizes, costs.verify_seconds)
        result = {
            "dtype": dtype,
            "model": loaded.describe(),
            "backend": backend_label(lm),
            "linear": loaded.linear,
            "verify_seconds": {str(n): costs.verify_seconds[n] for n in sizes},
        }
        if args.compare_stock and loaded.linear != "stock":
            set_cpu_linear(loaded.model, loaded.linear, enabled=False)
            stock = measure_costs(lm, None, max(sizes), repeats=args.repeats, sizes=sizes)
            print("PyTorch's stock linear kernels:")
            print_curve(sizes, stock.verify_seconds)
            ratios, own, plain = one_token_pairs(lm, loaded, 3 * args.repeats)
            print(
                f"one-token pass, {len(ratios)} adjacent pairs: specgen's kernels"
                f" {1000 * statistics.median(own):.0f} ms,"
                f" stock {1000 * statistics.median(plain):.0f} ms (medians); specgen's / stock: median"
                f" {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}"
            )
            result["stock_verify_seconds"] = {str(n): stock.verify_seconds[n] for n in sizes}
            result["one_token_pairs"] = {"specgen_seconds": own, "stock_seconds": plain, "ratios": ratios}
            if loaded.stock_rows:
                side_by_side = kernel_choices(lm, loaded.model, sizes, args.repeats)
                print_choices(sizes, side_by_side)
                result["kernel_choices"] = {
                    name: {str(n): seconds[n] for n in sizes} for name, seconds in side_by_side.items()
                }
        results.append(result)
        del lm, loaded
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "repeats": args.repeats,
                    "results": results,
                    "environment": {
                        "cpu": cpu_name(),
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                        "threads": torch.get_num_threads(),
                    },
                },
                indent=2,
            )
        )
    return 0


def print_curve(sizes: list[int], seconds: dict[int, float]) -> None:
    one = seconds[1]
    print("| tokens fed | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    print("| ms | " + " | ".join(f"{seconds[n] * 1000:.0f}" for n in sizes) + " |")
    print("| x one token | " + " | ".join(f"{seconds[n] / one:.2f}" for n in sizes) + " |")


KERNEL_CHOICES = ("specgen", "onednn", "stock")


def kernel_choices(lm, model, sizes: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Median seconds of a pass over each size with float32's rows given to specgen's choice
    of kernel, to oneDNN's throughout and to PyTorch's throughout: the three timed back to
    back for each size, the order reversed every other round. Leaves specgen's choice."""
    chosen = {module: module.stock_below for module in model.modules() if type(module) is OneDnnLinear}

    def use(choice: str) -> None:
        set_onednn_linear(model, choice != "stock")
        for module, below in chosen.items():
            module.stock_below = 1 if choice == "onednn" else below

    context = filler_ids(lm.vocab_size, CONTEXT_TOKENS + max(sizes))
    lm.rollback(0)
    lm.forward(context[:CONTEXT_TOKENS], all_logits=False)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in KERNEL_CHOICES}
    for round_ in range(rounds + 1):  # the first round warms up
        for n in sizes:
            for name in KERNEL_CHOICES if round_ % 2 else reversed(KERNEL_CHOICES):
                use(name)
                started = time.perf_counter()
                lm.forward(context[CONTEXT_TOKENS : CONTEXT_TOKENS + n])
                if round_:
                    times[name][n].append(time.perf_counter() - started)
                lm.rollback(CONTEXT_TOKENS)
    use("specgen")
    lm.rollback(0)
    return {name: {n: statistics.median(seconds) for n, seconds in by_size.items()} for name, by_size in times.items()}


def print_choices(sizes: list[int], choices: dict[str, dict[int, float]]) -> None:
    one = choices["specgen"][1]
    labels = {"specgen": "specgen's choice", "onednn": "oneDNN, all rows", "stock": "PyTorch's, all rows"}
    print("float32 kernels side by side (ms; x specgen's one-token pass):")
    print("| kernels | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, seconds in choices.items():
        cells = " | ".join(f"{seconds[n] * 1000:.0f} ({seconds[n] / one:.2f})" for n in sizes)
        print(f"| {labels[name]} | {cells} |")


def one_token_pairs(lm, loaded, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """One-token passes with specgen's kernels and with the stock ones, adjacent, the order
    alternating: (specgen's / stock per pair, specgen's seconds, stock seconds). Leaves the
    model on specgen's kernels."""
    context = filler_ids(lm.vocab_size, CONTEXT_TOKENS + 1)
    lm.rollback(0)
    lm.forward(context[:-1], all_logits=False)

    def seconds(own: bool) -> float:
        set_cpu_linear(loaded.model, loaded.linear, enabled=own)
        started = time.perf_counter()
        lm.forward(context[-1:], all_logits=False)
        elapsed = time.perf_counter() - started
        lm.rollback(CONTEXT_TOKENS)
        return elapsed

    pairs = alternating_pairs(lambda: seconds(True), lambda: seconds(False), rounds)
    own_seconds, stock_seconds = [own for own, _ in pairs], [stock for _, stock in pairs]
    ratios = [own / stock for own, stock in pairs]
    set_cpu_linear(loaded.model, loaded.linear)
    lm.rollback(0)
    return ratios, own_seconds, stock_seconds


if __name__ == "__main__":
    sys.exit(main())
