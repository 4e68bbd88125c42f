#!/bin/bash
# A Megatron-LM LLaMA-2 pretraining launch, written as Megatron-LM's examples/llama scripts
# write it (the same flag groups and flags), with pretrain_gpt.py replaced by
# pretrain_llama.py. Nothing else changes for a Megatron-LM user.
#
#   examples/megatron_llama2_launch.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] \
#       [TOKENIZER_MODEL|DEMO] [DATA_PREFIX|DEMO] [extra flags...]
#
# MODEL_SIZE: tiny (default without a GPU: CPU processes play the GPUs), 7B, 13B, 70B
# (LLaMA-2), or one of the paper's sizes 10b ... 110b. GPUS_PER_NODE defaults to the GPUs
# nvidia-smi lists, or 2 CPU processes. DEMO: the built-in demo corpus and its tokenizer;
# MOCK: megatron-core's synthetic data (as Megatron's example's MOCK).
# Run it twice: the second run resumes from CHECKPOINT_PATH (--save and --load name it).
set -euo pipefail

CHECKPOINT_PATH=${1:-"checkpoints/llama2"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama2"}
TOKENIZER_ARG=${3:-"DEMO"}  # a Hugging Face tokenizer directory, or DEMO, or MOCK
DATA_ARG=${4:-"DEMO"}       # a data prefix (PREFIX_text_document), or DEMO, or MOCK
shift $(( $# < 4 ? $# : 4 ))
EXTRA_ARGS=("$@")

GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
GPUS_PER_NODE=${GPUS_PER_NODE:-$(( GPUS > 0 ? GPUS : 2 ))}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}
MODEL_SIZE=${MODEL_SIZE:-$([ "$GPUS" -gt 0 ] && echo 7B || echo tiny)}

# Pipeline stages: all of a node's GPUs form one pipeline (forward and backward stages on
# different GPUs); more nodes add data-parallel replicas.
TP_SIZE=1
CP_SIZE=1
PP_SIZE=${PP_SIZE:-$GPUS_PER_NODE}

case "$MODEL_SIZE" in
    tiny) NUM_LAYERS=4;  HIDDEN=128;  FFN=352;   HEADS=4;  KV_GROUPS=2; SEQ=128
          MICRO_BATCH_SIZE=4; GLOBAL_BATCH_SIZE=8;   TRAIN_ITERS=${TRAIN_ITERS:-50}; DTYPE=fp32 ;;
    7B)   NUM_LAYERS=32; HIDDEN=4096; FFN=11008; HEADS=32; KV_GROUPS=32; SEQ=4096
          MICRO_BATCH_SIZE=1; GLOBAL_BATCH_SIZE=64;  TRAIN_ITERS=${TRAIN_ITERS:-500000}; DTYPE=bf16 ;;
    13B)  NUM_LAYERS=40; HIDDEN=5120; FFN=13824; HEADS=40; KV_GROUPS=40; SEQ=4096
          MICRO_BATCH_SIZE=1; GLOBAL_BATCH_SIZE=64;  TRAIN_ITERS=${TRAIN_ITERS:-500000}; DTYPE=bf16 ;;
    70B)  NUM_LAYERS=80; HIDDEN=8192; FFN=28672; HEADS=64; KV_GROUPS=8;  SEQ=4096
          MICRO_BATCH_SIZE=1; GLOBAL_BATCH_SIZE=64;  TRAIN_ITERS=${TRAIN_ITERS:-500000}; DTYPE=bf16 ;;
    10b|19b|30b|40b|52b|69b|88b|110b)
          PRESET=$MODEL_SIZE; DTYPE=bf16; TRAIN_ITERS=${TRAIN_ITERS:-500000} ;;
    *) echo "MODEL_SIZE $MODEL_SIZE: expected tiny, 7B, 13B, 70B or 10b ... 110b" >&2; exit 2 ;;
esac

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

if [ -n "${PRESET:-}" ]; then
    SIZE_ARGS=(--model-preset "$PRESET")
else
    SIZE_ARGS=(
        --num-layers "$NUM_LAYERS"
        --hidden-size "$HIDDEN"
        --ffn-hidden-size "$FFN"
        --num-attention-heads "$HEADS"
        --group-query-attention
        --num-query-groups "$KV_GROUPS"
        --seq-length "$SEQ"
        --max-position-embeddings "$SEQ"
        --micro-batch-size "$MICRO_BATCH_SIZE"
        --global-batch-size "$GLOBAL_BATCH_SIZE"
    )
fi

MODEL_ARGS=(
    --use-mcore-models
    "${SIZE_ARGS[@]}"
    --group-query-attention
    --position-embedding-type rope
    --rotary-base 10000
    --rotary-percent 1.0
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --make-vocab-size-divisible-by 128
    --transformer-impl transformer_engine
    --attention-backend auto
)

TRAINING_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --optimizer adam
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
    --exit-duration-in-mins 230
)
if [ "$DTYPE" = bf16 ]; then TRAINING_ARGS+=(--bf16); fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --context-parallel-size "$CP_SIZE"
    --pipeline-model-parallel-size "$PP_SIZE"
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --distributed-backend nccl
    --distributed-timeout-minutes 60
)

if [ "$DATA_ARG" = MOCK ] || [ "$TOKENIZER_ARG" = MOCK ]; then
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 32000
        --num-workers 1
        --no-create-attention-mask-in-dataloader
    )
elif [ "$DATA_ARG" = DEMO ] || [ "$TOKENIZER_ARG" = DEMO ]; then
    DATA_ARGS=(--num-workers 1)  # no --data-path: the built-in demo corpus
else
    DATA_ARGS=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --split 99,1,0
        --num-workers 1
        --no-create-attention-mask-in-dataloader
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --eval-iters 0
    --save-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --log-timers-to-tensorboard
    --ckpt-format torch_dist
)

cd "$(dirname "$0")/.."
# The project's launcher (make setup's .venv), else one on PATH (an activated environment,
# NVIDIA's image); TORCHRUN overrides both.
if [ -z "${TORCHRUN:-}" ]; then
    if [ -x .venv/bin/torchrun ]; then TORCHRUN=.venv/bin/torchrun
    elif command -v torchrun >/dev/null; then TORCHRUN=torchrun
    else
        echo "megatron_llama2_launch.sh: no torchrun: run \`make setup\` (it makes .venv/bin/torchrun), activate an environment with torch, or set TORCHRUN" >&2
        exit 2
    fi
fi
exec $TORCHRUN "${DISTRIBUTED_ARGS[@]}" pretrain_llama.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
