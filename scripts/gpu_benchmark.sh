#!/usr/bin/env bash
# specgen on a GPU with no download: a synthetic Qwen2.5-7B-shaped target, an independent
# 0.5B-shaped draft and a "self" draft (the target's first layers), random weights, a real
# tokenizer (scripts/synthetic_pair.py). One call, meant to finish in under 8 minutes on an H200:
#
#   1. the CUDA tests (graph replay = eager logits, graphed greedy decoding = generate)
#   2. the pair written to $PAIR (made on the GPU: seconds; about 20 GB on disk)
#   3. scripts/benchmark.py, bfloat16, --cuda-graphs auto: target + independent draft
#   4. the same with the self draft (high acceptance), then with --cuda-graphs off (DynamicCache)
#
#   bash scripts/gpu_benchmark.sh [OUT_DIR]
#
# Environment: TOKENIZER (a tokenizer folder; the GPU machine has no GGUF, so make one here first:
# `python scripts/synthetic_pair.py --export-tokenizer gpu-tokenizer` and carry it), SCALE (real; tiny
# tests this script on a CPU in a minute or two), DEVICE (cuda; cpu for that test), DTYPE (bfloat16),
# LIMIT (prompts, 4), NEW (new tokens per prompt, 64), PAIR (where the models go; an existing pair
# is reused), QUANT (none; 4bit for bitsandbytes NF4).
set -euo pipefail
out=${1:-${OUT:-bench-gpu}}
scale=${SCALE:-real}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
limit=${LIMIT:-4}
new=${NEW:-64}
quant=${QUANT:-none}
tokenizer=${TOKENIZER:-gpu-tokenizer}
pair=${PAIR:-/tmp/specgen-synthetic-$scale}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS
stamp() { echo "[gpu_benchmark +$((SECONDS - started)) s] $*" >&2; }

if [[ $device == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    stamp "CUDA tests"
    python -m pytest -q -m cuda tests/test_static_backend.py 2>&1 | tee "$out/cuda-tests.txt" || true
fi
if [[ ! -f $pair/synthetic.json ]]; then
    stamp "writing the $scale pair to $pair"
    python scripts/synthetic_pair.py "$pair" --scale "$scale" --tokenizer "$tokenizer" --device "$device" \
        --dtype "$dtype" 2>&1 | tee "$out/pair.txt"
fi
cp "$pair/synthetic.json" "$out/"

bench() {  # name, draft folder, --cuda-graphs
    stamp "benchmark $1"
    python scripts/benchmark.py --device "$device" --quant "$quant" --dtypes "$dtype" \
        --target "$pair/target" --draft "$2" --cuda-graphs "$3" \
        --limit "$limit" --max-new-tokens "$new" --methods hf-plain,specgen-plain,specgen-draft \
        --json-out "$out/$1.json" 2>"$out/$1.log" | tee "$out/$1.txt"
}
status=0
bench independent-draft "$pair/draft" auto || status=1
bench self-draft "$pair/self-draft" auto || status=1
bench self-draft-no-graphs "$pair/self-draft" off || status=1
stamp "done (results in $out)"
exit $status
