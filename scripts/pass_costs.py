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
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from speccli.config import LoadConfig
from speccli.engine.calibration import measure_costs
from speccli.generation.pipeline import backend_label, causal_lm
from speccli.models.loading import cpu_name, load_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16,17,24,32,48,64",
                        help="comma-separated numbers of tokens fed (1 is always timed: the ratios need it)")
    parser.add_argument("--repeats", type=int, default=5)
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
        loaded = load_model(args.model, LoadConfig(device=args.device, dtype=dtype),
                            progress=lambda message: print(message, file=sys.stderr))
        lm = causal_lm(loaded)
        costs = measure_costs(lm, None, max(sizes), repeats=args.repeats, sizes=sizes)
        one = costs.verify_seconds[1]
        print(f"\n{loaded.describe()} [{backend_label(lm)}]")
        print("| tokens fed | " + " | ".join(str(n) for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        print("| ms | " + " | ".join(f"{costs.verify_seconds[n] * 1000:.0f}" for n in sizes) + " |")
        print("| x one token | " + " | ".join(f"{costs.verify_seconds[n] / one:.2f}" for n in sizes) + " |")
        results.append({"dtype": dtype, "model": loaded.describe(), "backend": backend_label(lm),
                        "verify_seconds": {str(n): costs.verify_seconds[n] for n in sizes}})
        del lm, loaded
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "model": args.model, "repeats": args.repeats, "results": results,
            "environment": {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                            "threads": torch.get_num_threads()},
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
