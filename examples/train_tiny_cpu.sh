#!/usr/bin/env bash
# The tiny preset on this machine's CPU: 2 processes, each plays one GPU (gloo).
# Usage: examples/train_tiny_cpu.sh [extra pretrain_llama.py flags]
# Writes runs/tiny-cpu-example/ (make train's runs/tiny/ stays as it was).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
exec .venv/bin/torchrun --standalone --nproc-per-node 2 pretrain_llama.py \
    --model-preset tiny --pipeline-schedule decoupled --forward-stages 4 --backward-split 1 \
    --metrics-file runs/tiny-cpu-example/metrics.jsonl \
    --timeline runs/tiny-cpu-example/timeline.png --trace runs/tiny-cpu-example/trace.json "$@"
