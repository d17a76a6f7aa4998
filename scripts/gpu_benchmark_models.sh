#!/usr/bin/env bash
# The benchmark on a CUDA machine: target and draft in 4-bit (bitsandbytes NF4) and unquantized.
#
#   bash scripts/gpu_benchmark_models.sh TARGET DRAFT [OUT_DIR]
#
# (scripts/gpu_benchmark.sh times a synthetic 7B/0.5B pair instead: no download, random weights.)
#
# TARGET and DRAFT must be loadable there without a download: local folders or cached Hub ids
# (Qwen/Qwen2.5-Coder-1.5B-Instruct, Qwen/Qwen2.5-Coder-0.5B-Instruct). bitsandbytes cannot
# quantize a GGUF file, so the offline GGUF pair runs unquantized only; save it as folders first
# (load_model(...).model.save_pretrained) for the 4-bit run.
set -euo pipefail
target=${1:?target model}
draft=${2:?draft model}
out=${3:-${OUT:-bench-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# On CUDA specgen's own draft is loaded like transformers' (no int8), so that column would repeat hf-assisted.
methods=hf-assisted,hf-prompt-lookup,specgen-draft,specgen-ngram
python scripts/benchmark.py --device cuda --quant 4bit --dtypes bfloat16 --target "$target" --draft "$draft" \
    --limit 12 --max-new-tokens 128 --methods "$methods" --json-out "$out/gpu-4bit.json" | tee "$out/gpu-4bit.txt"
python scripts/benchmark.py --device cuda --quant none --dtypes bfloat16,float32 --target "$target" --draft "$draft" \
    --limit 12 --max-new-tokens 128 --methods "$methods" --json-out "$out/gpu-none.json" | tee "$out/gpu-none.txt"
