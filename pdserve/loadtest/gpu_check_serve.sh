#!/usr/bin/env bash
# Step 3 of pdserve/loadtest/gpu_check.sh (run by it under a time limit): `pdserve up --colocated` on $DEVICE, wait for the
# router's /health, then `pdserve bench serve`. The ensemble's pid goes to $OUT/up.pid; gpu_check.sh stops it
# whatever happens here (and so does this script's own exit). Reads PY, DEVICE, DTYPE, PORT, PROMPTS, KV_GIB, OUT.
set -uo pipefail
"$PY" -m pdserve.services.cli up --colocated --device "$DEVICE" --dtype "$DTYPE" --port "$PORT" \
    --max-num-seqs 256 --kv-cache-memory "${KV_GIB}GiB" --log-dir "$OUT/up-logs" --no-restart-workers \
    --startup-timeout-s 100 >"$OUT/up.log" 2>&1 &
UP=$!
echo "$UP" >"$OUT/up.pid"
trap 'kill -INT $UP 2>/dev/null' EXIT
WAIT='
import os, sys, time, urllib.request
port, pid, device = sys.argv[1], int(sys.argv[2]), os.environ.get("DEVICE")
deadline = time.time() + 105
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("pdserve up exited before it was ready")
    try:
        # the router answers /health before the workers are up; `pdserve up: ready` follows every child's /health
        ready = "pdserve up: ready" in open(os.path.join(os.environ["OUT"], "up.log")).read()
        if ready and urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(print(f"pdserve up --colocated --device {device} ready on port {port}"))
    except Exception:
        pass
    time.sleep(1)
sys.exit("pdserve up: not ready in 105 s")
'
if ! "$PY" -c "$WAIT" "$PORT" "$UP"; then
    echo "end of pdserve up's log ($OUT/up.log):"
    tail -30 "$OUT/up.log"
    exit 1
fi
"$PY" -m pdserve.services.cli bench serve --base-url "http://127.0.0.1:$PORT" --model smollm2-135m-instruct \
    --dataset random --random-input-len 512 --random-output-len 128 --num-prompts "$PROMPTS" \
    --request-rate inf --max-concurrency 64 --ignore-eos --num-warmups 8 --metric-percentiles 50,90,99 \
    --save-result "$OUT/serve.json"
# bench serve exits 0 when every request failed: the step passes only if all of them completed
"$PY" - "$OUT/serve.json" <<'CHECK'
import json, sys
r = json.load(open(sys.argv[1]))
completed, failed = r.get("completed", 0), r.get("failed", 0)
sys.exit(0 if completed > 0 and not failed else f"bench serve: {completed} completed, {failed} failed")
CHECK
