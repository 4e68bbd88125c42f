"""The flags of Megatron-LM 0.19's example launch scripts (tag core_v0.19.0), as the
program receives them: examples/llama/train_llama3_8b_h100_fp8.sh (mock data),
examples/gpt3/train_gpt3_175b_distributed.sh and
examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (Megatron-FSDP, mock data, with the
NSYS_PROFILE=1 flags). Every flag and its value as written there; only the sizes, lengths and
paths are scaled to a tiny CPU run. The scripts expand their arrays unquoted, so
"--split '99,1,0'" arrives as two words, the quotes kept.

Plain data (no imports): the tests read it here, and it can be fed to Megatron-LM's own
parser in an environment with megatron-core 0.19.2."""

TINY_MODEL = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "160", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
    "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
LLAMA_TRAINING = [
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "160",
    "--lr-decay-samples", "152", "--lr-warmup-samples", "8", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
PARALLEL = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
            "--sequence-parallel"]
DDP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
MOCK_DATA = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--data-cache-path", "CACHE", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
]

LLAMA = [
    *TINY_MODEL, *LLAMA_TRAINING,
    "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
    "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    *DDP, *FP8, *PARALLEL, *MOCK_DATA,
    "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",
    "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
    "--profile-step-end", "6", "--ckpt-format", "torch_dist",
    "--distributed-timeout-minutes", "60", "--save", "CKPT", "--load", "CKPT",
    "--tensorboard-dir", "TB",
]

GPT3 = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
    "--train-iters", "20", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
    "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "18",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "DATA", "--vocab-file", "VOCAB", "--merge-file", "MERGES",
    "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000",
    "--eval-interval", "1000", "--save", "CKPT", "--load", "CKPT", "--eval-iters", "10",
    "--tensorboard-dir", "TB",
]

FSDP = [
    *TINY_MODEL, *LLAMA_TRAINING,
    "--cross-entropy-loss-fusion", "--no-check-for-nan-in-loss-and-grad", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
    "--no-gradient-accumulation-fusion", "--calculate-per-token-loss",
    "--init-model-with-meta-device", "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub",
    "--fsdp-double-buffer", "--fsdp-manual-registration",
    "--profile", "--profile-step-start", "8", "--profile-step-end", "12",
    "--profile-ranks", "0", "--record-memory-history",
    *DDP, *FP8, *PARALLEL, *MOCK_DATA,
    "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",
    "--save-interval", "1000", "--log-throughput", "--logging-level", "20",
    "--distributed-timeout-minutes", "60", "--save", "CKPT", "--load", "CKPT",
    "--tensorboard-dir", "TB",
]

SCRIPTS = {"examples/llama": LLAMA, "examples/gpt3": GPT3, "examples/megatron_fsdp": FSDP}
