"""The command line: Megatron-style flags to one checked RunConfig.

Flags given explicitly override the preset's values; a preset's values override the built-in
defaults. The only module that sees argparse: everything else reads the RunConfig. Every
inconsistency is reported as one line naming the flag, the value and what was expected,
with exit status 2, before anything is allocated or written.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from megatron.config.errors import ConfigError, flag_name
from megatron.config.launcher_env import speaks_for_the_job
from megatron.config.model import ARCHITECTURE_DEFAULTS, MODEL_FIELDS
from megatron.config.placement import parse_gpu_stride
from megatron.config.presets import PRESETS, get_preset
from megatron.config.run import ONE_PROCESS_SCHEDULE, RunConfig
from megatron.config.tokenizer_names import TOKENIZER_TYPES
from megatron.data.cache import default_cache_dir
from megatron.schedules.generators import SCHEDULE_NAMES
from megatron.training.checkpointing import (
    FORCED_CHECKPOINT_ARGS,
    CheckpointError,
    checkpoint_args,
    reading_checkpoint,
)
from megatron.training.megatron_flags import (
    DESIGN_FLAGS,
    DESIGN_SWITCHES,
    REFUSED_SWITCHES,
    REFUSED_VALUES,
    TUNING_VALUES,
    check_design_flags,
)
from megatron.training.megatron_lm_flag_names import MEGATRON_LM_FLAGS

SCHEDULES = (ONE_PROCESS_SCHEDULE, *SCHEDULE_NAMES)

# Defaults of the flags a preset may set (None in argparse, so that "given" can be told from
# "defaulted"): Megatron-LM's where Megatron has one, ours where Megatron requires the flag.
DEFAULTS: dict[str, object] = {
    "micro_batch_size": 1,  # Megatron: required
    "global_batch_size": None,  # = micro_batch_size x data-parallel size (Megatron's)
    "train_iters": 100,  # Megatron: required (or --train-samples)
    "lr": 3e-4,  # Megatron: required
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_decay_iters": None,  # = train_iters
    "lr_decay_style": "linear",
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "seed": 1234,
    "log_interval": 100,
    "save_interval": None,
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    **ARCHITECTURE_DEFAULTS,
}
# Megatron's default split of --data-path's documents into train, validation and test.
DEFAULT_SPLIT = "969,30,1"
SIGNALS = {s.name: s for s in signal.Signals}


class FlagParser(argparse.ArgumentParser):
    """Megatron's parsing without argparse's surprises: no prefix matching (--num-layer is
    not --num-layers), and every error is one line (no usage block)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, formatter_class=OneLineHelp,
                         usage="%(prog)s [FLAGS]  (--help: every flag in one line)", **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(*_argparse_message(message))


class OneLineHelp(argparse.HelpFormatter):
    """--help: one line per flag, its value and what it does."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=48, width=10_000)

    def _format_action(self, action: argparse.Action) -> str:
        invocation = self._format_action_invocation(action)
        text = " ".join(self._expand_help(action).split()) if action.help else ""
        return f"  {invocation:<46} {text}\n"


def _argparse_message(message: str) -> tuple[str, str, str]:
    """argparse's 'argument --lr: invalid float value: 'x'' as (flag, value, expected)."""
    if message.startswith("argument "):
        flag, _, rest = message[len("argument "):].partition(": ")
        flag = flag.split("/")[-1]
        if "invalid" in rest and ":" in rest:
            kind, _, value = rest.partition(": ")
            return flag, value.split(" (")[0], kind.replace("invalid", "expected a valid") + (
                " (" + value.split(" (", 1)[1] if " (" in value else "")
        return flag, "", rest
    return "flags", "", message


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="pretrain_llama.py",
        description="Pretrain a LLaMA-2 model with model states in host memory. Flags that "
                    "share Megatron-LM's name take Megatron's meaning and default.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-preset", default=None, metavar="NAME",
                   help=f"one of: {', '.join(PRESETS)}; sets the sizes and LLaMA-2's "
                        "training recipe; explicit flags override its values")
    g.add_argument("--num-layers", type=int, help="decoder layers")
    g.add_argument("--hidden-size", type=int, help="model width")
    g.add_argument("--ffn-hidden-size", type=int,
                   help="SwiGLU inner width (default: Megatron's 2/3 x 4 x hidden, a "
                        "multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, help="query heads")
    g.add_argument("--num-query-groups", type=int,
                   help="key/value heads, with --group-query-attention (default: 1 with it, "
                        "as in Megatron; one per query head without it)")
    g.add_argument("--kv-channels", type=int,
                   help="channels per attention head (default: hidden size / heads)")
    g.add_argument("--seq-length", type=int, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int,
                   help="longest sequence the rotary embedding is built for, >= --seq-length "
                        "(default: --seq-length)")
    g.add_argument("--rotary-base", type=int, help="RoPE base (theta; default 10000)")
    g.add_argument("--rotary-percent", type=float,
                   help="share of each head's channels that RoPE rotates (default 1.0)")
    g.add_argument("--norm-epsilon", type=float, help="RMSNorm epsilon (default 1e-5)")
    g.add_argument("--init-method-std", type=float,
                   help="std of the normal initialization (default 0.02; output projections "
                        "scaled by 1/sqrt(2 x layers), as megatron-core does)")
    g.add_argument("--attention-dropout", type=float,
                   help="0 only (the default here): see README's differences")
    g.add_argument("--hidden-dropout", type=float,
                   help="0 only (the default here): see README's differences")
    g.add_argument("--vocab-size", type=int,
                   help="NullTokenizer: its size N (ids 0..N-1); without --tokenizer-type: the "
                        "model's vocabulary (default: the tokenizer's); no effect with the "
                        "other types, which know their own (Megatron-LM 0.19); then padded")
    g.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="pad the vocabulary to a multiple of this (default 128, Megatron's)")
    g.add_argument("--print-model-size", action="store_true",
                   help="print the parameter count and model-state memory, then exit")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch (default 1)")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per iteration: a multiple of --micro-batch-size x the "
                        "data-parallel size (default: their product)")
    g.add_argument("--train-iters", type=int, help="iterations to train (default 100)")
    g.add_argument("--train-samples", type=int,
                   help="samples to train, instead of --train-iters (iterations = samples / "
                        "global batch); the LR schedule then counts samples")
    g.add_argument("--lr", type=float, help="peak learning rate (default 3e-4)")
    g.add_argument("--min-lr", type=float, help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, help="iterations of linear warmup")
    g.add_argument("--lr-warmup-samples", type=int,
                   help="samples of linear warmup (with --train-samples)")
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="warmup as a fraction of the decay, below 1 (instead of iterations or "
                        "samples)")
    g.add_argument("--lr-decay-iters", type=int, help="iterations of decay (default: all)")
    g.add_argument("--lr-decay-samples", type=int,
                   help="samples of decay (with --train-samples; default: all)")
    g.add_argument("--lr-decay-style",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="default linear (Megatron's; the presets use cosine)")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   help="WSD: the shape of the final decay")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the final decay")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD: samples of the final decay (with --train-samples)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate the linear warmup starts from, 0 to --lr (default 0)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="with --load: this run's LR schedule flags, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="with --load: the checkpoint's LR schedule (the default here; "
                        "Megatron refuses a mismatch without one of the two)")
    g.add_argument("--weight-decay", type=float, help="decoupled weight decay (default 0.01)")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at the start (with --weight-decay-incr-style linear "
                        "or cosine)")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the end of training (with --weight-decay-incr-style "
                        "linear or cosine)")
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"],
                   help="weight decay from --start- to --end-weight-decay over the training "
                        "(default constant: --weight-decay)")
    g.add_argument("--clip-grad", type=float, help="global gradient-norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=float, help="Adam beta1 (default 0.9)")
    g.add_argument("--adam-beta2", type=float, help="Adam beta2 (default 0.999)")
    g.add_argument("--adam-eps", type=float, help="Adam epsilon (default 1e-8)")
    g.add_argument("--seed", type=int, help="initialization and data order: 1 to 2^32 - 1 (default 1234)")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 working parameters and gradients")
    prec.add_argument("--fp16", action="store_true",
                      help="fp16 working parameters and gradients, dynamic loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: this static loss scale instead of the dynamic one")
    g.add_argument("--initial-loss-scale", type=float,
                   help="fp16: the dynamic scale's start (default 2^32)")
    g.add_argument("--min-loss-scale", type=float, help="fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=int,
                   help="fp16: clean iterations before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int,
                   help="fp16: overflows tolerated before the dynamic scale halves (default 2)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, nargs="+", metavar="[WEIGHT] PREFIX",
                   help="prefix of a .bin/.idx indexed dataset, or Megatron's weighted list "
                        "'0.7 PREFIX_A 0.3 PREFIX_B' (a blend); default: the built-in demo corpus")
    g.add_argument("--split", default=None, metavar="TRAIN,VALID,TEST",
                   help="Megatron's split of the documents of --data-path into train, "
                        f"validation and test (default {DEFAULT_SPLIT}, Megatron's)")
    for split_name in ("train", "valid", "test"):
        g.add_argument(f"--{split_name}-data-path", default=None, nargs="+",
                       metavar="[WEIGHT] PREFIX",
                       help=f"the {split_name} dataset (or weighted blend) on its own, instead "
                            "of a split of --data-path")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="tokenizer JSON from tools/train_tokenizer.py (required with --data-path); "
                        "with --tokenizer-type: a Hugging Face directory or a SentencePiece model")
    g.add_argument("--tokenizer-type", default=None, metavar="|".join(TOKENIZER_TYPES),
                   help="Megatron's tokenizer names; the model's vocabulary is the tokenizer's, "
                        "--vocab-size has no effect (NullTokenizer: --vocab-size N ids, the "
                        "last the end of document), as Megatron-LM 0.19")
    g.add_argument("--vocab-file", default=None, metavar="PATH",
                   help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", default=None, metavar="PATH",
                   help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core's synthetic MockGPTDataset instead of files (with "
                        "--tokenizer-type NullTokenizer --vocab-size N, as Megatron's examples)")
    g.add_argument("--data-cache-path", "--data-cache-dir", dest="data_cache_dir",
                   default=None, metavar="DIR",
                   help="where the demo corpus and dataset indices are cached "
                        "(default: $MEGATRON_SYSX_CACHE or ~/.cache/megatron-sysx)")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, help="print every N iterations (default 100)")
    g.add_argument("--log-throughput", action="store_true",
                   help="print tokens/s and TFLOP/s per GPU in the iteration line")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the iteration's time breakdown to TensorBoard")
    g.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="append one JSON object per iteration")
    g.add_argument("--save", default=None, metavar="DIR", help="checkpoint directory")
    g.add_argument("--save-interval", type=int,
                   help="with --save: save every N iterations (and at the end, and on a clean "
                        "exit)")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from this checkpoint directory")
    g.add_argument("--load-optional", action="store_true",
                   help="Megatron's behaviour: a --load directory that does not exist means "
                        "start from scratch (default: an error, unless it is the --save "
                        "directory: auto-resume)")
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="checkpoint format: torch_dist (megatron-core's dist_checkpointing, "
                        "Megatron's default; the only one supported)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --load: do not read the optimizer state (fresh Adam moments)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="with --load: do not restore the RNG state")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: a missing checkpoint is an error, never a fresh start")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="with --load: take the model shape flags from the checkpoint")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations (default: only at the end)")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="iterations (global batches) per evaluation; 0 disables "
                        "(default: 100 with a validation set, else 0)")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard event files with Megatron's scalar names")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the training scalars every N iterations (default 1)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events the TensorBoard writer queues before it flushes (default 1000)")
    g.add_argument("--wandb-project", default=None, help="log the same scalars to W&B")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, metavar="DIR",
                   help="W&B's local files (default: --save's wandb/, as Megatron)")
    g.add_argument("--wandb-entity", default=None, help="W&B team or user of the run")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and exit 0 after the iteration that is a multiple of N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 once the job has run this long (Slurm time limits)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (and SIGUSR1): finish the iteration, save, exit 0 "
                        "on every rank")
    g.add_argument("--exit-signal", default="SIGTERM", metavar="SIGNAL",
                   help="the signal --exit-signal-handler acts on, by name or number "
                        "(default SIGTERM, Megatron's)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: read the weights only and start at iteration 0 with a "
                        "fresh optimizer (e.g. a checkpoint from tools/convert_checkpoint.py)")
    g.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=False,
                   help="write checkpoints in a background thread after a host-memory "
                        "snapshot (default off, as Megatron; training then blocks only for "
                        "the snapshot)")

    g = p.add_argument_group("pipeline")
    g.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="default: single (one process), decoupled with several")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="processes per pipeline; the launcher's processes / this are "
                        "data-parallel replicas (Megatron's layout; default: one pipeline of "
                        "all processes)")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="replicas of the pipeline, each on its share of the global batch "
                        "(world size = pipeline size x this; default: from the world size)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of collective operations (default 10, Megatron's)")
    g.add_argument("--zero-stage", type=int, default=None, metavar="0|1|2",
                   help="ZeRO over the host optimizer: 1 splits the optimizer states across "
                        "the data-parallel replicas, 2 the gradients too (default 2 when "
                        "--data-parallel-size > 1, else 0)")
    g.add_argument("--forward-stages", type=int, default=None,
                   help="forward stages of the pipeline (default: the schedule's)")
    g.add_argument("--backward-split", type=int, default=None,
                   help="backward stages per forward stage (decoupled schedule)")
    g.add_argument("--stage-layers", type=_int_list, default=None, metavar="N,N,...",
                   help="decoder layers per forward stage (default: balanced by cost, "
                        "embedding and head counted)")
    g.add_argument("--procs-per-node", type=int, default=None,
                   help="processes per node (default: torchrun's LOCAL_WORLD_SIZE); smaller "
                        "values simulate several nodes on one host")
    g.add_argument("--schedule-file", default=None, metavar="FILE.csv",
                   help="run this schedule (from tools/simulate_pipeline.py --schedule-file, "
                        "maybe edited by hand) instead of generating one; it is validated "
                        "and must match the run's ranks, micro-batches and layers")
    g.add_argument("--optimizer-gpu-stride", type=_gpu_stride, default=0,
                   metavar="auto|K|device:N|0",
                   help="update every K-th optimizer subgroup of the stages whose update would "
                        "be exposed on the GPU, the others on the CPU; device:N: N-1 of every "
                        "N on the GPU, the N-th on the CPU (auto: the faster of the two by "
                        "the calibrated performance model; 0: all on the CPU)")
    g.add_argument("--optimizer-subgroup-size", type=int, default=None, metavar="N",
                   help="parameters per optimizer subgroup (default: an eighth of the "
                        "largest owned stage, at least 4096)")
    g.add_argument("--optimizer-gpu-resident-fraction", type=float, default=0.0, metavar="F",
                   help="the static baseline (Twin-Flow): this fraction of every stage's "
                        "optimizer state lives on the GPU and is always updated there")
    g.add_argument("--optimizer-state-location", default="host", choices=["host", "nvme"],
                   help="where master, m and v live: host memory, or files on an NVMe drive "
                        "(--optimizer-nvme-path) with a window of stages in host memory")
    g.add_argument("--optimizer-nvme-path", default=None, metavar="DIR",
                   help="directory on a local drive for the optimizer state files (twice "
                        "the states: the committed and the staged version)")
    g.add_argument("--optimizer-exact-rollback", action="store_true",
                   help="overflow rollbacks and clipping corrections bit-exact instead of "
                        "inverting AdamW (host states: a snapshot of each step, as many bytes "
                        "again as the states; NVMe states: free, the file keeps the committed "
                        "version); the same numbers wherever the states live")
    g.add_argument("--cpu-optimizer-threads", type=int, default=None,
                   help="threads of each process's CPU optimizer (default: cores / processes)")
    g.add_argument("--optimizer-state-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="Adam's m and v in host memory (bf16: half the bytes, rounded to "
                        "nearest; needs the CPU optimizer, i.e. a pipeline)")
    g.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the master weights in host memory (bf16: rounded stochastically "
                        "with bits keyed by --seed, parameter, element and step)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="bf16 runs: the micro-batches' gradients are summed on the device, "
                        "reach host memory, are reduced across data-parallel replicas and "
                        "read by the CPU optimizer in bf16, 2 bytes per parameter "
                        "(Megatron-LM's: main gradients in bf16; default: fp32)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="fp16 runs: the main gradients (summed on the device, in host "
                        "memory) in fp32 instead of fp16 (Megatron-LM's flag; bf16 runs' "
                        "are fp32 already; --grad-reduce-in-bf16 wins, as there)")
    g.add_argument("--master-rounding", default="stochastic", choices=["stochastic", "nearest"],
                   help="how a bf16 master rounds (nearest: for comparison; small updates "
                        "are lost)")
    g.add_argument("--timeline", default=None, metavar="FILE.png",
                   help="draw the measured last iteration, one row per rank (like the simulator)")
    g.add_argument("--trace", default=None, metavar="FILE.json",
                   help="Chrome-trace JSON of the measured last iteration")
    g.add_argument("--p2p-check", action="store_true",
                   help="testing aid: send a small header with every point-to-point tensor "
                        "and fail, naming what arrived, when it is not the tensor the "
                        "receiving instruction expects (one host sync per message)")
    g.add_argument("--inject-overflow", type=_int_list, default=None, metavar="ITER,STAGE,SUB",
                   help="testing aid: make backward stage (STAGE, SUB)'s gradient non-finite at "
                        "iteration ITER (one process: any stage)")
    g.add_argument("--device-sanitizer", action="store_true",
                   help="check every access of the device layer's buffers against the order "
                        "the streams declare and fail at the first race, naming the buffer, "
                        "both streams and both instructions (CPU device; on CUDA: torch's "
                        "CUDA sanitizer)")
    g.add_argument("--device-chaos", type=int, default=None, metavar="SEED",
                   help="testing aid (CPU device): delay each copy stream's operations by "
                        "seeded random amounts, so that a missing wait changes the numbers")
    g.add_argument("--share-gpu", action="store_true",
                   help="testing aid: let more processes than GPUs run on a node, the local "
                        "ranks sharing the GPUs over gloo (point-to-point staged through "
                        "pinned host buffers); without it that is refused")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end): with "
                        "--use-pytorch-profiler a torch profiler trace in --tensorboard-dir, "
                        "each instruction a PP:<cell> range; alone, the CUDA profiler API "
                        "for nsys (CUDA only)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler instead of nsys")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="the first iteration profiled")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="the first iteration after the profiled ones")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[], metavar="R",
                   help="global ranks that profile (default: every rank, as Megatron)")
    g = p.add_argument_group("planning")
    g.add_argument("--plan", action="store_true",
                   help="print the memory needed per GPU and per node, whether it fits the "
                        "--hardware profile and the predicted iteration time, then exit "
                        "(0: fits, 3: does not)")
    g.add_argument("--auto-config", action="store_true",
                   help="search schedule, forward stages, backward split and micro-batch size "
                        "for the fastest simulated iteration that fits; print the top 5 and "
                        "train the best (with --plan: only print)")
    g.add_argument("--json", action="store_true", help="--plan prints one JSON object")
    g.add_argument("--nodes", type=int, default=None, help="nodes to plan for (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node to plan for (default: the hardware profile's)")
    g.add_argument("--hardware", default=None, metavar="PROFILE",
                   help="a built-in hardware profile (paper-v100, h100-sxm, dgx-h100, "
                        "h100-host128) or a JSON file from tools/profile_hardware.py "
                        "(default for --plan: paper-v100); a training run prices its plan "
                        "on it and records the prediction beside each measured iteration")
    _add_megatron_design_flags(p)
    return p


def _add_megatron_design_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags that name this design or tune what it does not have
    (megatron/training/megatron_flags.py): accepted, or refused in one line."""
    g = p.add_argument_group("Megatron-LM flags that describe this design")
    for spec in DESIGN_FLAGS:
        g.add_argument(spec.flag, type=spec.type, default=None, choices=spec.choices,
                       help=spec.help)
    for flag, what in DESIGN_SWITCHES.items():
        g.add_argument(flag, action="store_true", help=what)
    for flag, (kind, default, choices, what) in TUNING_VALUES.items():
        g.add_argument(flag, type=kind, default=default, choices=choices, help=what)
    for flag, why in REFUSED_SWITCHES.items():
        g.add_argument(flag, action="store_true", help=why)
    for flag, why in REFUSED_VALUES.items():  # all their values, to refuse them as one
        g.add_argument(flag, default=None, nargs="+", help=why)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def _check_query_groups_switch(args: argparse.Namespace, given: set[str]) -> None:
    """Megatron-LM builds grouped-query attention only with --group-query-attention: a
    --num-query-groups given without it is ignored there (multi-head attention). Taking
    either meaning silently would train another model than the script's author gets from
    one of the two, so a group count other than the heads' needs the switch."""
    heads, groups = args.num_attention_heads, args.num_query_groups
    if ("num_query_groups" in given and not args.group_query_attention
            and heads is not None and groups != heads):
        raise ConfigError("--num-query-groups", groups,
                          "needs --group-query-attention beside it (without it Megatron-LM "
                          "ignores the group count and builds multi-head attention): add "
                          "--group-query-attention, or drop --num-query-groups")


def _apply_preset_and_defaults(args: argparse.Namespace, given: set[str]) -> None:
    """Fill what the user left out: the preset's values, then the defaults, then the values
    that follow from other flags (as Megatron resolves them). `given`: the flags on the
    command line, by argparse name."""
    if args.model_preset is not None:
        try:
            preset = get_preset(args.model_preset)
        except KeyError:
            raise ConfigError(
                "--model-preset", args.model_preset, f"expected one of {', '.join(PRESETS)}"
            ) from None
        args.model_preset = preset.name
        for name in MODEL_FIELDS:
            if getattr(args, name) is None:
                setattr(args, name, getattr(preset, name))
        for name, value in preset.training.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    _check_query_groups_switch(args, given)
    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron's default with --group-query-attention
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _resolve_layout(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _resolve_training_length(args, given)
    if args.num_query_groups is None and args.num_attention_heads is not None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        # Megatron's SwiGLU width: 2/3 of 4h, a multiple of 64
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.zero_stage is None:
        args.zero_stage = 2 if args.data_parallel_size > 1 else 0
    if args.use_distributed_optimizer and args.data_parallel_size > 1 and args.zero_stage == 0:
        raise ConfigError("--zero-stage", 0, "--use-distributed-optimizer shards the optimizer "
                          "state over the data-parallel replicas: give --zero-stage 1 or 2")
    if args.split is None and args.data_path is not None:
        args.split = DEFAULT_SPLIT
    if args.data_cache_dir is None:
        args.data_cache_dir = default_cache_dir()
    args.exit_signal = _signal_name(args.exit_signal)


def _resolve_layout(args: argparse.Namespace) -> None:
    """Megatron's layout: world size = pipeline size x data-parallel size (tensor and context
    parallel sizes 1). Without either flag, all the launcher's processes form one pipeline."""
    world = int(os.environ.get("WORLD_SIZE", "0")) or None
    pipeline, replicas = args.pipeline_model_parallel_size, args.data_parallel_size
    if replicas is None and pipeline is not None and world is not None:
        if pipeline <= 0 or world % pipeline:
            raise ConfigError("--pipeline-model-parallel-size", pipeline,
                              f"expected a divisor of the {world} processes started (world "
                              "size = pipeline size x data-parallel size)")
        replicas = world // pipeline
    args.data_parallel_size = 1 if replicas is None else replicas


def _resolve_training_length(args: argparse.Namespace, given: set[str]) -> None:
    """Iteration-based (--train-iters) or sample-based (--train-samples) training, as
    Megatron checks them; the LR schedule counts samples either way (RunConfig)."""
    iteration_flags = {"train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"}
    sample_flags = {"lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"}
    # A warmup given as 0 is Megatron's default, which its checks accept beside the others.
    given = {name for name in given if not (name in ("lr_warmup_iters", "lr_warmup_samples")
                                            and getattr(args, name) == 0)}
    if args.train_samples is not None:
        mixed = sorted(iteration_flags & given)
        if mixed:
            raise ConfigError(flag_name(mixed[0]), getattr(args, mixed[0]),
                              "not with --train-samples: give the schedule in samples "
                              "(--lr-decay-samples, --lr-warmup-samples)")
        if args.train_samples < args.global_batch_size:
            raise ConfigError("--train-samples", args.train_samples,
                              f"expected at least one global batch ({args.global_batch_size})")
        args.train_iters = args.train_samples // args.global_batch_size
        args.lr_warmup_iters = 0
    else:
        mixed = sorted(sample_flags & given)
        if mixed:
            raise ConfigError(flag_name(mixed[0]), getattr(args, mixed[0]),
                              "needs --train-samples (with --train-iters give "
                              f"--{mixed[0].replace('samples', 'iters').replace('_', '-')})")
        if "lr_warmup_iters" not in given and args.lr_warmup_iters >= args.train_iters:
            # A preset's warmup is sized for its own train_iters; a short run keeps 10% of it.
            args.lr_warmup_iters = args.train_iters // 10
    if args.lr_warmup_fraction is not None and ({"lr_warmup_iters", "lr_warmup_samples"}
                                                & given):
        raise ConfigError("--lr-warmup-fraction", args.lr_warmup_fraction,
                          "give one of --lr-warmup-fraction and --lr-warmup-iters/samples")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_samples is None:
        args.lr_warmup_samples = 0


def _signal_name(value: str) -> str:
    """--exit-signal by name (SIGUSR1, USR1) or number (10), as the signal's name."""
    text = str(value).upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text)).name
        except ValueError:
            pass
    name = text if text.startswith("SIG") else "SIG" + text
    if name not in SIGNALS or name in ("SIGKILL", "SIGSTOP"):
        raise ConfigError("--exit-signal", value, "expected a signal that can be caught, by "
                          "name or number (e.g. SIGTERM, SIGUSR1, 10)")
    return name


def _gpu_stride(text: str) -> int | None:
    """--optimizer-gpu-stride: 'auto' (None), an integer K >= 0, or device:N (-N)."""
    try:
        return parse_gpu_stride(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse and check; exits with status 2 and a one-line message on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            raise ConfigError(*_unknown_flags(parser, unknown))
        given = _given(parser, argv)
        check_design_flags(vars(args))
        if args.use_checkpoint_args and args.load:
            _take_checkpoint_args(args)
        _apply_preset_and_defaults(args, given)
        return RunConfig.from_flags(vars(args))
    except ConfigError as exc:
        exit_bad_input(exc)


def _take_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args, as Megatron-LM reads it before checking the flags: the model
    flags --load's checkpoint recorded fill those not given (some replace them)."""
    try:
        with reading_checkpoint(args.load):  # an unreadable one: one line, not a traceback
            saved = checkpoint_args(args.load)
    except CheckpointError as exc:
        raise ConfigError("--load", args.load, str(exc)) from None
    if saved is None:
        if os.environ.get("RANK", "0") == "0":
            print(f"--use-checkpoint-args: no checkpoint in {args.load}; the model flags "
                  "given apply", flush=True)
        return
    for name, value in saved.items():
        if name in FORCED_CHECKPOINT_ARGS or getattr(args, name) is None:
            setattr(args, name, value)


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The argparse names of the flags on the command line (`--flag=value` included)."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    return {by_option[item.split("=", 1)[0]] for item in argv
            if item.split("=", 1)[0] in by_option}


def _unknown_flags(parser: argparse.ArgumentParser, unknown: Sequence[str]
                   ) -> tuple[str, str, str]:
    """Every unknown flag, as one ConfigError's parts: a typo with the closest known flag,
    a Megatron-LM flag this design lacks as such."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    flags = [item.split("=", 1)[0] for item in unknown if item.startswith("-")]
    if not flags:
        return "flags", " ".join(unknown), "unexpected values (every value follows its flag)"
    megatron = [flag for flag in flags if flag in MEGATRON_LM_FLAGS]
    lacking = (f"Megatron-LM 0.19 flag{'s' if len(megatron) > 1 else ''}", ", ".join(megatron),
               "not supported by this design (--help lists the flags it takes): drop "
               + ("them" if len(megatron) > 1 else "it"))
    parts = []
    for flag in flags:
        if flag not in MEGATRON_LM_FLAGS:
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            parts.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    if not parts:
        return lacking
    also = "; also " + str(ConfigError(*lacking)) if megatron else ""
    return ("unknown flag" + ("s" if len(parts) > 1 else ""), ", ".join(parts),
            "not a flag of pretrain_llama.py (--help lists every flag, one line each)" + also)


def exit_bad_input(exc: Exception) -> None:
    """One line on stderr (from rank 0 only, when several processes run), exit status 2."""
    if speaks_for_the_job():
        details = getattr(exc, "details", "")  # e.g. the programs around a schedule's fault
        if details:
            print(details, file=sys.stderr)
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr)
    raise SystemExit(2)
