#!/usr/bin/env bash
# Decode throughput at tensor-parallel sizes 1, 2 and 4 on the GPUs of a lent machine (issue 14): one process per
# rank, rank r on cuda:r, NCCL all-reduces. The default model (9 heads) cannot split in 2 or 4, so this writes a
# Llama of 1B-like shape (hidden 2048, 16 layers, 32 heads, 8 KV heads) with random weights: speed only, the
# tokens are noise. Sizes above the GPU count are skipped (a machine of one GPU measures TP=1 only).
# Run from the repository's parent with PYTHONPATH set as for the tests; about 3 minutes on an H100-class GPU.
#     bash pdserve/loadtest/gpu_tp.sh [batch=64] [output_len=128]
set -euo pipefail
BATCH=${1:-64}
OUT_LEN=${2:-128}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
SIZES=1
[ "$GPUS" -ge 2 ] && SIZES=1,2
[ "$GPUS" -ge 4 ] && SIZES=1,2,4
echo "GPUs: $GPUS; TP sizes measured: $SIZES"
DIR=$(mktemp -d)/llama-1b-random
python -c "from pdserve.loadtest.tp_bench import write_random_llama; write_random_llama('$DIR')"
python -m pdserve.services.cli bench tp --model "$DIR" --device cuda --dtype bfloat16 --tp-sizes "$SIZES" \
    --batch "$BATCH" --prompt-len 128 --output-len "$OUT_LEN" --rounds 2 --num-kv-blocks 2048
