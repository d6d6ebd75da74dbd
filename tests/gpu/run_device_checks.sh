#!/usr/bin/env bash
# Every GPU check and benchmark in one run: a GPU machine is lent for minutes, not hours.
#
#   bash tests/gpu/run_device_checks.sh            # on a machine with CUDA, from the repo root
#
# 1. pytest tests/gpu: Triton kernels compiled for the real device vs the torch references,
#    the target runner on CUDA vs CPU, the DeepSeek-V3 runner on CUDA, and every drafting
#    method on CUDA with greedy output equal to plain decoding (tiny demo family + heads);
# 2. outrider/benchmarks/verify_microbench.py --full: torch vs Triton verification;
# 3. outrider/benchmarks/gpu_verify_cost.py: the 32-layer Llama-3.1-8B shape (random bf16), paged: decode ms at
#    batch 1/16/64 as a share of the bandwidth bound, tree verify vs decode, transformers generate.
# Logs and result files go to $OUT (default ./out). Wheels in .whl/ (e.g. a newer protobuf
# than the machine has) are installed to /tmp/site first, for machines with no index.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/device_log.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# Without installing (no index there), the checkout's root serves: it holds only `outrider/`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A prebuilt tiny demo family (and heads) carried in .devcache/ saves building it there.
if [ -d .devcache/demo ]; then export OUTRIDER_HOME="$PWD/.devcache"; fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers, google.protobuf as pb; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__)"
} 2>&1 | tee "$LOG"
status=0
step() {  # step SECONDS CMD...: run with a time limit, log it, remember a failure
    local limit=$1; shift
    echo "=== $* (limit ${limit}s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== rc $rc in $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || status=1
}
step 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rA
if [ "${MICROBENCH:-1}" = 1 ]; then
    step 100 python3 -m outrider.benchmarks.verify_microbench --full --repeats 5
    cp benchmarks/results/verify_microbench_cuda.* "$OUT"/ 2>/dev/null
fi
step 420 python3 -m outrider.benchmarks.gpu_verify_cost --layers "${LAYERS:-32}" --context "${CONTEXT:-512}"
cp benchmarks/results/gpu_verify_cost.* "$OUT"/ 2>/dev/null
exit $status
