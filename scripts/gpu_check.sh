#!/usr/bin/env bash
# specgen's GPU check (scripts/gpu_check.py) on a machine with one CUDA GPU and no network, in
# one call of about 7 minutes: the CUDA tests (cut at $TEST_SECONDS), then the driver within
# $BUDGET seconds. Results: OUT/gpu_check.json and OUT/gpu_check.md (BENCHMARKS.md cites
# them), OUT/tests.txt, OUT/gpu.txt.
#
#   bash scripts/gpu_check.sh --prepare    # here, with network: the wheels the GPU image lacks
#                                          # into .whl, the Qwen tokenizer into gpu-tokenizer
#                                          # (both git-ignored; carry them)
#   bash scripts/gpu_check.sh [OUT]        # there (default OUT: $OUT, else gpu-check)
#
# Environment: BUDGET (the driver's seconds, 330), TEST_SECONDS (60; 0 skips the tests),
# FORMATS (weight formats, default the driver's: bf16,int4,int4-hqq,nf4,fp8,bf16+compile), PYTHON (python3).
set -uo pipefail
python=${PYTHON:-python3}
if [[ ${1:-} == --prepare ]]; then
    set -e
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    grep -qx '/gpu-tokenizer/' .git/info/exclude 2>/dev/null || echo '/gpu-tokenizer/' >> .git/info/exclude
    # The GPU image's Python is 3.12 and its torch 2.11: torchao 0.18 needs torch >= 2.11. It lacks
    # the rest too (the test suite's collection imports them).
    for wheel in torchao==0.18.0 bitsandbytes==0.50.2 prompt-toolkit==3.0.53 wcwidth==0.9.5 gguf==0.19.0 \
        pexpect==4.9.0 ptyprocess==0.7.0; do
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$wheel"
    done
    if [[ ! -d gpu-tokenizer ]]; then
        "$python" scripts/synthetic_pair.py --export-tokenizer gpu-tokenizer \
            || echo "gpu_check: no tokenizer exported (the offline Qwen package is missing); ids stand in for text" >&2
    fi
    ls -l .whl
    exit 0
fi
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [[ ${TEST_SECONDS:-60} != 0 ]]; then
    # SIGINT: pytest stops where it is and still prints its summary.
    timeout -s INT -k 15 "${TEST_SECONDS:-60}" "$python" -m pytest -q -m cuda -p no:cacheprovider -n 4 >"$out/tests.txt" 2>&1
    echo "gpu_check: CUDA tests exited $? ($(tail -n 1 "$out/tests.txt"))" >&2
fi
args=(--out "$out" --budget "${BUDGET:-330}")
[[ -d gpu-tokenizer ]] && args+=(--tokenizer gpu-tokenizer)
[[ -n ${FORMATS:-} ]] && args+=(--formats "$FORMATS")
# The driver keeps to its budget stage by stage; this only stops a stage that hangs.
timeout -s INT -k 30 $(( ${BUDGET:-330} + 60 )) "$python" scripts/gpu_check.py "${args[@]}"
