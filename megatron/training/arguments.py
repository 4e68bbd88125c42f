"""The command line: Megatron-style flags to one checked RunConfig.

Flags given explicitly override the preset's values; a preset's values override the built-in
defaults. The only module that sees argparse: everything else reads the RunConfig. Every
inconsistency is reported as one line naming the flag, the value and what was expected,
with exit status 2, before anything is allocated or written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megatron.config.errors import ConfigError
from megatron.config.model import MODEL_FIELDS
from megatron.config.presets import PRESETS, get_preset
from megatron.config.run import RunConfig
from megatron.data.cache import default_cache_dir
from megatron.schedules.generators import SCHEDULE_NAMES

SCHEDULES = ("single", *SCHEDULE_NAMES)

# Built-in defaults for flags that a preset may set (None in argparse so we can tell
# "given explicitly" from "defaulted").
DEFAULTS: dict[str, object] = {
    "micro_batch_size": 1,
    "global_batch_size": None,  # = micro_batch_size
    "train_iters": 100,
    "lr": 3e-4,
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_decay_iters": None,  # = train_iters
    "lr_decay_style": "cosine",
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
    "seed": 1234,
    "log_interval": 10,
    "save_interval": None,
    "initial_loss_scale": 2.0**16,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
}

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_llama.py",
        description="Pretrain a LLaMA-2 model with model states in host memory.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-preset", default=None, metavar="NAME",
                   help=f"one of: {', '.join(PRESETS)}; explicit flags override its values")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int, help="KV heads (grouped-query attention)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--vocab-size", type=int, help="default: the tokenizer's vocabulary size")
    g.add_argument("--print-model-size", action="store_true",
                   help="print the parameter count and model-state memory, then exit")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int,
                   help="a multiple of --micro-batch-size; the quotient is the number of "
                        "micro-batches accumulated per iteration")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip-grad", type=float, help="global gradient-norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--seed", type=int)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 working parameters and gradients")
    prec.add_argument("--fp16", action="store_true",
                      help="fp16 working parameters and gradients, dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float)
    g.add_argument("--min-loss-scale", type=float)
    g.add_argument("--loss-scale-window", type=int)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, nargs="+", metavar="[WEIGHT] PREFIX",
                   help="prefix of a .bin/.idx indexed dataset, or Megatron's weighted list "
                        "'0.7 PREFIX_A 0.3 PREFIX_B' (a blend); default: the built-in demo corpus")
    g.add_argument("--split", default=None, metavar="TRAIN,VALID,TEST",
                   help="Megatron's split of the documents of --data-path into train, "
                        "validation and test (default: 969,30,1 with --eval-iters > 0, else 1,0,0)")
    for split_name in ("train", "valid", "test"):
        g.add_argument(f"--{split_name}-data-path", default=None, nargs="+",
                       metavar="[WEIGHT] PREFIX",
                       help=f"the {split_name} dataset (or weighted blend) on its own, instead "
                            "of a split of --data-path")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="tokenizer JSON from tools/train_tokenizer.py (required with --data-path)")
    g.add_argument("--data-cache-dir", default=None, metavar="DIR",
                   help="where the demo corpus and dataset indices are cached "
                        "(default: $MEGATRON_SYSX_CACHE or ~/.cache/megatron-sysx)")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="append one JSON object per iteration")
    g.add_argument("--save", default=None, metavar="DIR")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--load", default=None, metavar="DIR")
    g.add_argument("--load-optional", action="store_true",
                   help="Megatron's behaviour: a --load directory that does not exist means "
                        "start from scratch (default: an error)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and at the end (default 1000)")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="iterations (global batches) per evaluation; 0 disables "
                        "(default: 10 with a validation set, else 0)")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard event files with Megatron's scalar names")
    g.add_argument("--wandb-project", default=None, help="log the same scalars to W&B")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and exit 0 after the iteration that is a multiple of N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 once the job has run this long (Slurm time limits)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1: finish the iteration, save, exit 0 on every rank")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: read the weights only and start at iteration 0 with a "
                        "fresh optimizer (e.g. a checkpoint from tools/convert_checkpoint.py)")
    g.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True,
                   help="write checkpoints in a background thread after a host-memory "
                        "snapshot (default on; --no-async-save blocks until written)")

    g = p.add_argument_group("pipeline")
    g.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="default: single (one process), decoupled with several")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="number of GPU processes; must equal the launcher's world size")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="replicas of the pipeline, each on its share of the global batch "
                        "(world size = pipeline size x this; megatron-core's rank layout)")
    g.add_argument("--zero-stage", type=int, default=None, metavar="0|1|2",
                   help="ZeRO over the host optimizer: 1 splits the optimizer states across "
                        "the data-parallel replicas, 2 the gradients too (default 2 when "
                        "--data-parallel-size > 1, else 0)")
    g.add_argument("--forward-stages", type=int, default=None)
    g.add_argument("--backward-split", type=int, default=None)
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
    g.add_argument("--optimizer-gpu-stride", type=_gpu_stride, default=0, metavar="auto|K|0",
                   help="update every K-th optimizer subgroup of the stages whose update would "
                        "be exposed on the GPU, the others on the CPU (auto: K from the "
                        "calibrated performance model; 0: all on the CPU)")
    g.add_argument("--optimizer-subgroup-size", type=int, default=None, metavar="N",
                   help="parameters per optimizer subgroup (default: an eighth of the "
                        "largest owned stage, at least 4096)")
    g.add_argument("--optimizer-gpu-resident-fraction", type=float, default=0.0, metavar="F",
                   help="the static baseline (Twin-Flow): this fraction of every stage's "
                        "optimizer state lives on the GPU and is always updated there")
    g.add_argument("--cpu-optimizer-threads", type=int, default=None,
                   help="threads of each process's CPU optimizer (default: cores / processes)")
    g.add_argument("--optimizer-state-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="Adam's m and v in host memory (bf16: half the bytes, rounded to "
                        "nearest; needs the CPU optimizer, i.e. a pipeline)")
    g.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the master weights in host memory (bf16: rounded stochastically "
                        "with bits keyed by --seed, parameter, element and step)")
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
    g.add_argument("--profile-ranks", type=_int_list, default=[0], metavar="R,R,...",
                   help="global ranks that profile")
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
                   help="a built-in hardware profile (paper-v100, h100-sxm) or a JSON file "
                        "from tools/profile_hardware.py (default: paper-v100)")
    return p


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def _apply_preset_and_defaults(args: argparse.Namespace) -> None:
    """Fill what the user left out: the preset's values, then the built-in defaults, then
    the defaults that follow from other flags (as Megatron resolves them)."""
    warmup_given = args.lr_warmup_iters is not None
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
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size
    if not warmup_given and args.lr_warmup_iters >= args.train_iters:
        # A preset's warmup is sized for its own train_iters; a short run keeps 10% of it.
        args.lr_warmup_iters = args.train_iters // 10
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.num_query_groups is None and args.num_attention_heads is not None:
        args.num_query_groups = args.num_attention_heads
    if args.zero_stage is None:
        args.zero_stage = 2 if args.data_parallel_size > 1 else 0
    if args.data_cache_dir is None:
        args.data_cache_dir = default_cache_dir()


def _gpu_stride(text: str) -> int | None:
    """--optimizer-gpu-stride: 'auto' (None) or an integer >= 0."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto or an integer >= 0")
    return value


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse and check; exits with status 2 and a one-line message on bad input."""
    args = build_parser().parse_args(argv)
    try:
        _apply_preset_and_defaults(args)
        return RunConfig.from_flags(vars(args))
    except ConfigError as exc:
        exit_bad_input(exc)


def exit_bad_input(exc: Exception) -> None:
    """One line on stderr (from rank 0 only, when several processes run), exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        details = getattr(exc, "details", "")  # e.g. the programs around a schedule's fault
        if details:
            print(details, file=sys.stderr)
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr)
    raise SystemExit(2)
