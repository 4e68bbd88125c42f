#!/usr/bin/env bash
# The SysX paper's 10B LLaMA-2 (Table 2) on one node of 4 GPUs (paper Fig. 9 setting:
# micro-batch 2, global batch 16 x nodes, sequence 1024). Needs ~160 GiB of host memory for the
# model states (20 bytes/param) and ~16 GiB of /dev/shm for the 16-bit parameters.
# Data: an indexed dataset made with tools/preprocess_data.py (see docs/data.md).
set -euo pipefail
DATA=${DATA:?set DATA to the .bin/.idx prefix}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the tokenizer JSON}
torchrun --standalone --nproc-per-node 4 pretrain_llama.py \
    --model-preset 10b --bf16 \
    --pipeline-schedule decoupled --forward-stages 8 --backward-split 2 \
    --micro-batch-size 2 --global-batch-size 16 --seq-length 1024 \
    --train-iters 1000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 \
    --data-path "$DATA" --tokenizer-model "$TOKENIZER" \
    --save checkpoints/10b --save-interval 200 --metrics-file runs/10b/metrics.jsonl "$@"
