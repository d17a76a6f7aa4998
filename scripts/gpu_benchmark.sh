#!/usr/bin/env bash
# specgen on a GPU with no download: a synthetic Qwen2.5-7B-shaped target, an independent
# 0.5B-shaped draft and a "self" draft (the target's first layers), random weights, a real
# tokenizer (scripts/synthetic_pair.py). One call, meant to finish in under 9 minutes on an H200:
#
#   1. the pair written to $PAIR in the background (made on the GPU: seconds; about 20 GB on disk),
#      while the whole test suite runs (CUDA tests included), cut at $TEST_SECONDS
#   2. scripts/benchmark.py, bfloat16, --cuda-graphs auto, the self draft (high acceptance):
#      plain, chain drafts, token trees, prompt lookup and lookahead
#   3. the same with the independent draft (acceptance near 0)
#   4. the self draft with a fixed k of 4 (what drafting gives, whatever k auto chooses)
#   5. the self draft with the target in bitsandbytes NF4 (QUANT4=0 skips it)
#   6. the self draft with --cuda-graphs off (eager passes; NO_GRAPHS=0 skips it)
#
#   bash scripts/gpu_benchmark.sh [OUT_DIR]
#
# Environment: TOKENIZER (a tokenizer folder; the GPU machine has no GGUF, so make one here first:
# `python scripts/synthetic_pair.py --export-tokenizer gpu-tokenizer` and carry it), SCALE (real; tiny
# tests this script on a CPU in a few minutes), DEVICE (cuda; cpu for that test), DTYPE (bfloat16),
# LIMIT (prompts, 4), NEW (new tokens per prompt, 64), PAIR (where the models go; an existing pair
# is reused), TESTS (1: run the suite first), TEST_SECONDS (150), STAGE_SECONDS (a factor on each
# benchmark's limit, 1). Every stage is cut at its limit (about 8 minutes in all) and the next one
# runs, so one slow stage costs only itself. SNAPSHOT (a .tgz path): the results folder is packed
# there after every stage, so a run cut short still returns what it measured.
set -uo pipefail
out=${1:-${OUT:-bench-gpu}}
scale=${SCALE:-real}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
limit=${LIMIT:-4}
new=${NEW:-64}
tokenizer=${TOKENIZER:-gpu-tokenizer}
pair=${PAIR:-/tmp/specgen-synthetic-$scale}
stretch=${STAGE_SECONDS:-1}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS
stamp() {
    echo "[gpu_benchmark +$((SECONDS - started)) s] $*" | tee -a "$out/stages.txt" >&2
    if [[ -n ${SNAPSHOT:-} ]]; then tar czf "$SNAPSHOT" -C "$(dirname "$out")" "$(basename "$out")"; fi
}

if [[ $device == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
        | tee -a "$out/gpu.txt"
fi
pair_pid=
if [[ ! -f $pair/synthetic.json ]]; then
    stamp "writing the $scale pair to $pair (background)"
    python scripts/synthetic_pair.py "$pair" --scale "$scale" --tokenizer "$tokenizer" --device "$device" \
        --dtype "$dtype" >"$out/pair.txt" 2>&1 &
    pair_pid=$!
fi
if [[ ${TESTS:-1} == 1 ]]; then
    stamp "the test suite (cut at ${TEST_SECONDS:-150} s)"
    # SIGINT: pytest stops where it is and still prints its summary.
    OMP_NUM_THREADS=1 timeout -s INT -k 20 "${TEST_SECONDS:-150}" \
        python -m pytest -q -n "${TEST_WORKERS:-12}" -p no:cacheprovider --durations=10 >"$out/tests.txt" 2>&1
    stamp "tests exited $? ($(tail -n 1 "$out/tests.txt"))"
fi
if [[ -n $pair_pid ]]; then
    wait "$pair_pid" || { stamp "the pair could not be written (see pair.txt)"; exit 1; }
fi
cp "$pair/synthetic.json" "$out/"

bench() {  # name, seconds, draft folder, --cuda-graphs, --quant, methods, [limit], [k]
    local name=$1 seconds=$(( $2 * stretch ))
    shift 2
    stamp "benchmark $name (cut at $seconds s)"
    timeout -s INT -k 20 "$seconds" \
        python scripts/benchmark.py --device "$device" --quant "$3" --dtypes "$dtype" \
        --target "$pair/target" --draft "$1" --cuda-graphs "$2" \
        --limit "${5:-$limit}" --max-new-tokens "$new" --methods "$4" --k "${6:-auto}" \
        --json-out "$out/$name.json" >"$out/$name.txt" 2>&1
    local rc=$?
    stamp "benchmark $name exited $rc"
    return $rc
}
status=0
all=hf-plain,specgen-plain,specgen-draft,specgen-tree,specgen-ngram,specgen-ngram-tree,specgen-lookahead
bench self-draft 140 "$pair/self-draft" auto none "$all" || status=1
bench independent-draft 70 "$pair/draft" auto none hf-plain,specgen-plain,specgen-draft,specgen-tree || status=1
bench self-draft-k4 60 "$pair/self-draft" auto none hf-plain,specgen-plain,specgen-draft,specgen-tree "$limit" 4 || status=1
if [[ ${QUANT4:-1} == 1 && $device == cuda* ]]; then
    bench self-draft-nf4 80 "$pair/self-draft" auto 4bit hf-plain,specgen-plain,specgen-draft,specgen-tree || status=1
fi
if [[ ${NO_GRAPHS:-1} == 1 ]]; then
    bench self-draft-no-graphs 45 "$pair/self-draft" off none hf-plain,specgen-plain,specgen-draft 2 || status=1
fi
stamp "done (results in $out)"
exit $status
