"""Megatron-LM flags that describe what this design always is, or tune what it does not have.

A Megatron-LM launch script for a LLaMA model names the architecture (`--normalization
RMSNorm --swiglu --position-embedding-type rope ...`), the kernels and the overlap of its
communication. pretrain_llama.py accepts each of them under Megatron's name: a value that
describes this design is accepted, a value it cannot honour is refused in one line that says
what is supported instead. Nothing here changes the computation; the flags that do (sizes,
rotary base, norm epsilon, ...) are fields of the run configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.config.errors import ConfigError


@dataclass(frozen=True)
class DesignFlag:
    """A flag whose accepted values are those this design is."""

    flag: str
    accepted: tuple[Any, ...] | None  # values that describe this design (None: any)
    instead: str  # said when another value is given
    choices: tuple[Any, ...] | None = None  # Megatron's choices (None: any value of its type)
    type: type = str
    help: str = ""

    @property
    def dest(self) -> str:
        return _dest(self.flag)


# Values the design is; the rest are refused. Defaults are this design (a LLaMA model),
# where Megatron's pretrain_gpt.py defaults to GPT's (README's table of differences).
DESIGN_FLAGS = (
    DesignFlag("--tensor-model-parallel-size", (1,), "tensor parallelism is not supported "
               "(a stage's layers run whole on one GPU, the model states live in host memory; "
               "use --pipeline-model-parallel-size and data parallelism)", type=int,
               help="1 only (tensor parallelism is not supported)"),
    DesignFlag("--context-parallel-size", (1,), "context parallelism is not supported (use "
               "a shorter --seq-length or more pipeline stages)", type=int,
               help="1 only (context parallelism is not supported)"),
    DesignFlag("--expert-model-parallel-size", (1,), "mixture-of-experts models are not "
               "supported", type=int, help="1 only (no mixture of experts)"),
    DesignFlag("--position-embedding-type", ("rope",), "LLaMA uses rotary embeddings",
               choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"),
               help="rope only (the default here)"),
    DesignFlag("--normalization", ("RMSNorm",), "LLaMA uses RMSNorm", choices=("LayerNorm", "RMSNorm"),
               help="RMSNorm only (the default here)"),
    DesignFlag("--recompute-granularity", ("full",), "the backward stage recomputes "
               "whole layers from the checkpointed activations",
               choices=("full", "selective"), help="full only (always: activations are "
               "recomputed by the backward stage)"),
    DesignFlag("--transformer-impl", ("local", "transformer_engine"),
               "training uses megatron-core's local or Transformer Engine layers",
               choices=("local", "transformer_engine", "inference_optimized"),
               help="Transformer Engine layers where it imports on CUDA, local otherwise"),
    DesignFlag("--optimizer", ("adam",), "the CPU optimizer is AdamW",
               choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
               help="adam only (AdamW, decoupled weight decay, as Megatron's adam)"),
    DesignFlag("--distributed-backend", None, "",
               choices=("nccl", "gloo"), help="NCCL on CUDA; the CPU device layer uses gloo"),
    DesignFlag("--attention-backend", None, "",
               choices=("flash", "fused", "unfused", "local", "auto"),
               help="auto, flash, fused: torch's scaled_dot_product_attention (Transformer "
                    "Engine's own choice where it is used); unfused, local: megatron-core's "
                    "unfused attention"),
    DesignFlag("--recompute-method", None, "",
               choices=("uniform", "block"), help="accepted; every layer is recomputed"),
    DesignFlag("--recompute-num-layers", None, "", type=int,
               help="accepted; every layer is recomputed"),
    DesignFlag("--num-experts", (None,), "mixture-of-experts models are not supported",
               type=int, help="not supported (no mixture of experts)"),
)

# Switches that describe this design (True) or only tune kernels, fusions and overlap that
# this runtime schedules itself: accepted, no effect on the numbers.
DESIGN_SWITCHES = {
    "--use-mcore-models": "megatron-core models (always)",
    "--use-rotary-position-embeddings": "rotary embeddings (always)",
    "--no-position-embedding": "no learned absolute positions (always)",
    "--swiglu": "SwiGLU MLP (always)",
    "--untie-embeddings-and-output-weights": "untied embedding and output layer (always)",
    "--disable-bias-linear": "linear layers without biases (always)",
    "--group-query-attention": "grouped-query attention with --num-query-groups",
    "--use-distributed-optimizer": "ZeRO over the host optimizer with data parallelism "
                                   "(--zero-stage, 2 by default)",
    "--overlap-grad-reduce": "gradient reduction overlaps the pipeline (always)",
    "--overlap-param-gather": "parameter publication overlaps the pipeline (always)",
    "--sequence-parallel": "no effect with tensor-parallel size 1 (as in Megatron)",
    "--no-masked-softmax-fusion": "kernel choice; no effect on the numbers",
    "--attention-softmax-in-fp32": "softmax in fp32 (always)",
    "--cross-entropy-loss-fusion": "kernel choice; no effect on the numbers",
    "--no-bias-swiglu-fusion": "kernel choice; no effect on the numbers",
    "--no-bias-dropout-fusion": "kernel choice; no effect on the numbers",
    "--no-rope-fusion": "kernel choice; no effect on the numbers",
    "--no-gradient-accumulation-fusion": "the unfused sum, which is this runtime's: each "
    "micro-batch's 16-bit weight gradient added into the fp32 main gradients",
    "--use-flash-attn": "kernel choice; no effect on the numbers",
    "--manual-gc": "accepted; Python's collector runs as usual",
    "--no-create-attention-mask-in-dataloader": "the causal mask is built by the model (always)",
    "--no-mmap-bin-files": "accepted; .bin files are memory-mapped",
    "--legacy-tokenizer": "accepted; text is tokenized by tools/preprocess_data.py (where "
                          "it applies), training reads token ids",
    "--tokenizer-hf-use-fast": "accepted; training reads token ids (see --legacy-tokenizer)",
    "--tokenizer-hf-include-special-tokens": "accepted; training reads token ids (see "
                                             "--legacy-tokenizer)",
    "--calculate-per-token-loss": "equal to the per-micro-batch mean here: every sample has "
                                  "seq-length loss tokens",
    "--no-check-for-nan-in-loss-and-grad": "accepted; a non-finite gradient skips the "
                                           "iteration here either way (Megatron stops)",
    "--init-model-with-meta-device": "accepted; the model is built once, in host memory",
    "--use-nccl-ub": "NCCL user buffers (Megatron-FSDP): no effect here",
    "--fsdp-double-buffer": "Megatron-FSDP buffer tuning: no effect here",
    "--fsdp-manual-registration": "Megatron-FSDP buffer tuning: no effect here",
    "--record-memory-history": "accepted; no CUDA memory history is recorded (--trace "
                               "records the last iteration)",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is written (always)",
    # how a torch_dist checkpoint is written or read, not what it holds
    "--ckpt-fully-parallel-save": "checkpoint I/O tuning (Megatron's default): no effect "
                                  "on what is saved",
    "--ckpt-fully-parallel-load": "checkpoint I/O tuning: no effect on what is loaded",
    "--use-persistent-ckpt-worker": "checkpoint I/O tuning: --async-save writes from a "
                                    "thread of its own either way",
    "--ckpt-assume-constant-structure": "checkpoint I/O tuning: no effect on what is saved",
    "--auto-detect-ckpt-format": "accepted; --load reads torch_dist, the only format",
}

# Megatron flags with a value that only tunes the runtime: accepted, no effect. By flag:
# (type, Megatron's default, Megatron's choices or None, what it does here).
TUNING_VALUES = {
    "--num-workers": (int, 2, None, "data loader workers; samples are read in the training "
                                    "process"),
    "--empty-unused-memory-level": (int, 0, (0, 1, 2), "accepted; device memory is released "
                                                       "per instruction"),
    "--tiktoken-pattern": (str, None, ("v1", "v2"), "only read by TikTokenizer (not "
                                                    "supported)"),
    # FP8 recipe details: Megatron reads them only with --fp8-format (refused here)
    "--fp8-amax-history-len": (int, 1, None, "FP8 recipe detail; no effect without "
                                             "--fp8-format"),
    "--fp8-amax-compute-algo": (str, "most_recent", ("most_recent", "max"),
                                "FP8 recipe detail; no effect without --fp8-format"),
    "--timing-log-level": (int, 0, (0, 1, 2), "Megatron's timer detail: the timers here are "
                                              "this runtime's (--log-timers-to-tensorboard)"),
    "--timing-log-option": (str, "minmax", ("max", "minmax", "all"), "Megatron's timer "
                            "reduction across ranks: see --timing-log-level"),
    "--logging-level": (int, None, None, "accepted; this program's log lines are not "
                                         "filtered by level"),
    # Megatron-FSDP's ZeRO stage, read only with --use-megatron-fsdp (refused here)
    "--data-parallel-sharding-strategy": (
        str, "optim_grads_params", ("no_shard", "optim", "optim_grads", "optim_grads_params"),
        "Megatron-FSDP's sharding; with data parallelism use --zero-stage"),
}

# Megatron switches naming features this design does not have: refused in one line.
REFUSED_SWITCHES = {
    "--apply-layernorm-1p": "zero-centred RMSNorm weights are not supported (LLaMA's "
                            "RMSNorm): drop --apply-layernorm-1p",
    "--use-legacy-models": "only megatron-core models are supported (drop --use-legacy-models)",
    "--add-qkv-bias": "linear layers have no biases (LLaMA); drop --add-qkv-bias",
    "--fp8-param-gather": "FP8 is not supported: use --bf16",
    "--recompute-activations": "selective recomputation; the backward stage recomputes "
                               "whole layers (always): drop --recompute-activations",
    "--eod-mask-loss": "every token's loss counts (Megatron's default): drop --eod-mask-loss",
    "--reset-position-ids": "positions run across documents (Megatron's default): drop "
                            "--reset-position-ids",
    "--reset-attention-mask": "attention runs across documents (Megatron's default): drop "
                              "--reset-attention-mask",
    "--qk-layernorm": "LLaMA has no query/key normalization: drop --qk-layernorm",
    "--squared-relu": "the MLP is LLaMA's SwiGLU (--swiglu)",
    "--openai-gelu": "the MLP is LLaMA's SwiGLU (--swiglu)",
    "--use-rope-scaling": "LLaMA-3.1's RoPE scaling is not supported: plain RoPE with "
                          "--rotary-base",
    "--no-save-optim": "a checkpoint always holds the optimizer state (a resume is exact): "
                       "drop --no-save-optim, load with --no-load-optim or --finetune",
    "--no-save-rng": "a checkpoint always holds the RNG state (a resume is exact): drop "
                     "--no-save-rng, load with --no-load-rng",
    "--use-megatron-fsdp": "Megatron-FSDP is not supported (the model states live in host "
                           "memory): for ZeRO over the data-parallel replicas use "
                           "--use-distributed-optimizer with --zero-stage 1 (optim) or 2 "
                           "(optim_grads; parameters are never sharded)",
}
REFUSED_VALUES = {
    "--fp8-format": "FP8 is not supported: use --bf16",
    "--decoupled-lr": "one learning rate for all parameters: drop --decoupled-lr",
    "--decoupled-min-lr": "one learning rate for all parameters: drop --decoupled-min-lr",
    "--rampup-batch-size": "batch-size ramp-up is not supported: give a constant "
                           "--global-batch-size",
    "--step-batch-size-schedule": "batch-size schedules are not supported: give a constant "
                                  "--global-batch-size",
    "--num-layers-per-virtual-pipeline-stage": "Megatron's interleaved schedule is not "
                                               "supported: choose one with --pipeline-schedule",
}


def check_design_flags(values: Mapping[str, Any]) -> None:
    """Raise ConfigError for the Megatron flags whose values this design cannot honour, all
    of them in its one line (a launch script learns every change at the first try);
    `values` by argparse name, as given (None: left out)."""
    refused = []
    for spec in DESIGN_FLAGS:
        value = values.get(spec.dest)
        if value is not None and spec.accepted is not None and value not in spec.accepted:
            accepted = " or ".join(str(a) for a in spec.accepted if a is not None)
            refused.append(ConfigError(spec.flag, value, f"expected {accepted}: {spec.instead}"))
    for flag, why in REFUSED_SWITCHES.items():
        if values.get(_dest(flag)):
            refused.append(ConfigError(flag, True, f"not supported: {why}"))
    for flag, why in REFUSED_VALUES.items():
        value = values.get(_dest(flag))
        if value is not None:
            refused.append(ConfigError(flag, " ".join(value), f"not supported: {why}"))
    if values.get("ckpt_format") not in (None, "torch_dist"):  # named with the others
        refused.append(ConfigError("--ckpt-format", values["ckpt_format"],
                                   "expected torch_dist (megatron-core's dist_checkpointing, "
                                   "Megatron's default), the only format supported"))
    if refused:
        first, others = refused[0], refused[1:]
        also = "; also " + "; ".join(str(e) for e in others) if others else ""
        raise ConfigError(first.flag, first.value, first.expected + also)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")
