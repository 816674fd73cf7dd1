#!/usr/bin/env bash
# The GPU check of issue 15, for a session that is lent one CUDA GPU: in under 10 minutes (the steps' limits add up
# to 600 s; about 6 minutes expected on an H100/H200) it checks and prints
#   0. that CUDA graphs give the eager engine's tokens (tests/engine/test_cuda_graphs.py: capture and replay of a tiny
#      model against its unpadded forward, and the default model's engine with graphs against --enforce-eager);
#   1. the Triton kernels' achieved bandwidth against the device's peak (pdserve/kernels/bench.py: correctness, then decode
#      and cache-write bandwidth against the data sheet's peak and a measured 2 GiB device-to-device copy);
#   2. offline throughput, pdserve alone, CUDA graphs on against --enforce-eager, in turns (pdserve bench throughput);
#   3. `pdserve bench serve` figures against `pdserve up --colocated` on the GPU (TTFT, TPOT, ITL, throughput).
# Each step has its own time limit; a step that fails or runs out of time is reported and the next one runs. The
# script exits 0 only if every step passed; with no CUDA GPU it stops at once (exit 2) and says so.
# Needs: torch with CUDA, triton, the project's Python dependencies, and the default model (smollm2-135m-instruct)
# resolvable offline. Run from anywhere; the package is this checkout (a pdserve -> repository link is put on
# PYTHONPATH). Everything goes to stdout and to $GPU_CHECK_OUT (default: a new temporary directory).
#     bash pdserve/loadtest/gpu_check.sh
# Knobs (environment): GPU_CHECK_REQUESTS (offline requests, default 256), GPU_CHECK_PROMPTS (bench serve prompts,
# default 256), GPU_CHECK_DTYPE (default bfloat16), GPU_CHECK_KV_GIB (KV cache per engine, default 8),
# GPU_CHECK_PORT (router port, default 18000), GPU_CHECK_STEPS (default "graphs kernels offline serve": a rerun of
# some). GPU_CHECK_DEVICE=cpu rehearses the script's own plumbing on a machine
# without a GPU (kernels in Triton's interpreter at small sizes, the engines on CPU): its figures mean nothing.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)  # the package pdserve/ of this checkout
CHECKOUT=$(dirname "$REPO")  # the repository root (tests/)
PP=$(mktemp -d -t pdserve-pp.XXXXXX)
ln -s "$REPO" "$PP/pdserve"
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the interpreter would run the kernels on the CPU
PY=${PYTHON:-python}
REQUESTS=${GPU_CHECK_REQUESTS:-256}
PROMPTS=${GPU_CHECK_PROMPTS:-256}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
PORT=${GPU_CHECK_PORT:-18000}
KV_GIB=${GPU_CHECK_KV_GIB:-8}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
STEPS=" ${GPU_CHECK_STEPS:-graphs kernels offline serve} "
START=$(date +%s)
declare -a SUMMARY=()
UP_PID=""
OUT=""

cleanup_up() {
    [ -z "$UP_PID" ] && [ -n "$OUT" ] && [ -f "$OUT/up.pid" ] && UP_PID=$(cat "$OUT/up.pid")
    if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
        kill -INT "$UP_PID" 2>/dev/null  # pdserve up stops every child it started
        for _ in $(seq 1 40); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$UP_PID" 2>/dev/null
        echo "gpu_check: pdserve up (pid $UP_PID) stopped"
    fi
    UP_PID=""
    [ -n "$OUT" ] && rm -f "$OUT/up.pid"
}
cleanup() {
    cleanup_up
    rm -rf "$PP"
}
trap cleanup EXIT

# step NAME SECONDS COMMAND...: run it with a time limit, its output to the screen and to $OUT/NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    [[ "$STEPS" == *" $name "* ]] || return 0
    echo
    echo "=== $name (limit ${limit} s) ==="
    local t0=$SECONDS rc
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("$name: ok (${took} s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("$name: TIMED OUT after ${limit} s; going on with the next step")
        echo "gpu_check: $name ran past its ${limit} s limit; going on with the next step" >&2
    else
        SUMMARY+=("$name: FAILED (exit $rc, ${took} s; log $OUT/$name.log); going on with the next step")
        echo "gpu_check: $name failed (exit $rc); going on with the next step" >&2
    fi
}

# 0. a CUDA GPU, or stop now
if [ "$DEVICE" = cpu ]; then
    echo "gpu_check: GPU_CHECK_DEVICE=cpu: a rehearsal of this script's steps on the CPU; the figures mean nothing"
elif ! timeout 30 "$PY" - <<'EOF'
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"gpu_check: cannot import torch ({e})")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA GPU visible to torch {torch.__version__} (CUDA build {torch.version.cuda}); "
             "this script measures a GPU and has nothing to do here")
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
EOF
then
    echo "gpu_check: FAILED: no usable CUDA GPU (see above); nothing was measured" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OUT=${GPU_CHECK_OUT:-$(mktemp -d -t pdserve-gpu-check.XXXXXX)}
mkdir -p "$OUT"
echo "results and logs: $OUT"

# 0. CUDA graphs give the eager tokens (needs the test dependencies: pip install -e ".[test]" or the like)
step graphs 80 "$PY" -m pytest -q -p no:cacheprovider -rs "$CHECKOUT/tests/engine/test_cuda_graphs.py"

# 1. kernels: correctness, bandwidth vs the data sheet and a measured copy (no engine run: step 2 is that)
if [ "$DEVICE" = cpu ]; then
    step kernels 120 "$PY" -m pdserve.kernels.bench --cpu-smoke --json "$OUT/kernels.json"
else
    step kernels 120 "$PY" -m pdserve.kernels.bench --no-engine --iters 50 --json "$OUT/kernels.json"
fi

# 2. offline throughput, pdserve only: CUDA graphs (default) against --enforce-eager, in turns
step offline 150 "$PY" -m pdserve.services.cli bench throughput --device "$DEVICE" --with-enforce-eager \
    --skip hf-static --skip hf-continuous --num-requests "$REQUESTS" --dtype "$DTYPE" --kv-gib "$KV_GIB" \
    --max-model-len 1024 --rounds 2 \
    --json-out "$OUT/offline.json"

# 3. bench serve against pdserve up --colocated on the GPU (one decode worker, TP 1: CUDA graphs on):
# pdserve/loadtest/gpu_check_serve.sh, whose ensemble this script stops afterwards (its pid in $OUT/up.pid)
export PY DTYPE PORT PROMPTS OUT DEVICE KV_GIB
step serve 190 bash "$REPO/loadtest/gpu_check_serve.sh"
cleanup_up

echo
echo "=== summary ($(( $(date +%s) - START )) s; logs and JSON in $OUT) ==="
failed=0
for line in "${SUMMARY[@]}"; do
    echo "  $line"
    case "$line" in *": ok "*) ;; *) failed=1 ;; esac
done
exit $failed
