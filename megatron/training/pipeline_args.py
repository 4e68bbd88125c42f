"""From the command-line flags to a validated `PipelineConfig`.

Checks what can be checked before any data or model exists, resolves the defaults (forward
stages, backward split, the flop-balanced partition), and generates the schedule or reads
it from `--schedule-file`. Every problem is an ArgumentError naming the flag, the value and
what was expected, raised before anything is allocated.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from megatron.models.presets import ModelPreset
from megatron.optimizer.cpu_adam import usable_cores
from megatron.optimizer.rounding import STATE_DTYPES, state_bytes_per_param
from megatron.pipeline.config import (
    LossScaling,
    OptimizerSettings,
    PipelineConfig,
    SubgroupSettings,
)
from megatron.schedules.cost_model import preset_partition
from megatron.schedules.generators import (
    ONE_STAGE_PER_RANK,
    RECOMPUTE_BACKWARD_RATIO,
    build_schedule,
)
from megatron.schedules.grid import format_programs
from megatron.schedules.instructions import BackwardStage, Schedule
from megatron.schedules.interpreter import ScheduleError
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.schedule_file import read_schedule
from megatron.schedules.validator import validate
from megatron.training.arguments import ArgumentError
from megatron.training.data_cache import default_cache_dir
from megatron.training.train_step import training_dtype


def check_pipeline_args(args: argparse.Namespace, world_size: int) -> None:
    """What can be checked before any data or model exists (exit 2 on failure)."""
    size = args.pipeline_model_parallel_size
    if size is not None and size != world_size:
        raise ArgumentError("--pipeline-model-parallel-size", size,
                            f"must equal the number of processes started ({world_size}); "
                            f"launch with torchrun --nproc-per-node {size}")
    if args.pipeline_schedule == "single" and world_size > 1:
        raise ArgumentError("--pipeline-schedule", "single",
                            f"runs in one process, but {world_size} were started")
    stages = args.forward_stages
    if stages is not None and stages < world_size:
        raise ArgumentError("--forward-stages", stages,
                            f"expected at least one stage per process ({world_size})")
    if stages is not None and stages > args.num_layers:
        raise ArgumentError("--forward-stages", stages,
                            f"more stages than layers ({args.num_layers})")
    if world_size > args.num_layers:
        raise ArgumentError("--pipeline-model-parallel-size", world_size,
                            f"more processes than layers ({args.num_layers})")
    if args.backward_split is not None and args.backward_split < 1:
        raise ArgumentError("--backward-split", args.backward_split, "expected >= 1")
    if args.stage_layers is not None:
        resolve_partition(args, stages or len(args.stage_layers), vocab_size=1)
    if args.schedule_file is not None:
        load_schedule_file(args, world_size)


def resolve_partition(args: argparse.Namespace, forward_stages: int, vocab_size: int,
                      min_layers: int = 1) -> tuple[int, ...]:
    """--stage-layers as given, or balanced by cost (embedding and head counted) with at
    least `min_layers` per stage (the backward split needs that many)."""
    if args.stage_layers is not None:
        layers = tuple(args.stage_layers)
        if len(layers) != forward_stages or sum(layers) != args.num_layers or min(layers) < 1:
            raise ArgumentError(
                "--stage-layers", ",".join(map(str, layers)),
                f"expected {forward_stages} positive layer counts (one per forward stage) "
                f"summing to --num-layers ({args.num_layers})")
        return layers
    model = ModelPreset("custom", args.num_layers, args.hidden_size, args.ffn_hidden_size,
                        args.num_attention_heads, args.num_query_groups, args.seq_length,
                        vocab_size)
    try:
        return tuple(preset_partition(model, forward_stages, args.seq_length, min_layers))
    except ValueError as exc:
        raise ArgumentError("--backward-split", min_layers, str(exc)) from None


def generate_schedule(args: argparse.Namespace, world_size: int, vocab_size: int,
                      lower: bool = True) -> Schedule:
    """The schedule the flags describe (the defaults filled in), with the optimizer's
    device subgroups placed when --optimizer-gpu-stride asks for them; with `lower` False,
    its shape only (no programs, see build_schedule)."""
    name = args.pipeline_schedule or "decoupled"
    if name == "single":
        name = "decoupled"
    stages = args.forward_stages
    if stages is None:
        stages = args.stage_layers and len(args.stage_layers) or (
            world_size if name in ONE_STAGE_PER_RANK or args.num_layers < 2 * world_size
            else 2 * world_size)
    split = args.backward_split
    if split is None:
        split = 2 if name == "decoupled" and args.num_layers >= 2 * stages else 1
    partition = resolve_partition(args, stages, vocab_size, min_layers=split)
    micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    try:
        schedule = build_schedule(name, world_size, stages, split, micro_batches, partition,
                                  backward_ratio=RECOMPUTE_BACKWARD_RATIO, lower=lower)
    except ValueError as exc:
        flag = "--backward-split" if "split" in str(exc) else "--forward-stages"
        raise ArgumentError(flag, split if flag == "--backward-split" else stages,
                            str(exc)) from None
    if lower and args.optimizer_gpu_stride != 0:  # device subgroups where updates are exposed
        schedule = place_device_subgroups(schedule)
    return schedule


class ScheduleFileError(ArgumentError):
    """A schedule file that cannot run; `details` shows the programs around the fault."""

    def __init__(self, path: str, expected: str, details: str = "") -> None:
        super().__init__("--schedule-file", path, expected)
        self.details = details


def load_schedule_file(args: argparse.Namespace, world_size: int) -> Schedule:
    """Read, check against this run's flags, and validate --schedule-file."""
    path = args.schedule_file
    try:
        schedule = read_schedule(path)
    except ValueError as exc:
        raise ScheduleFileError(path, str(exc)) from None
    run = {"ranks": world_size,
           "micro_batches": args.global_batch_size // (args.micro_batch_size
                                                        * args.data_parallel_size),
           "forward_stages": args.forward_stages, "backward_split": args.backward_split,
           "partition": tuple(args.stage_layers) if args.stage_layers else None,
           "name": args.pipeline_schedule}
    for key, wanted in run.items():
        found = schedule.shape()[key]
        if wanted is not None and found != wanted:
            raise ScheduleFileError(path, f"the file has {key}={found}, this run has {wanted}")
    if sum(schedule.partition) != args.num_layers:
        raise ScheduleFileError(path, f"the file's partition {list(schedule.partition)} has "
                                      f"{sum(schedule.partition)} layers, --num-layers is "
                                      f"{args.num_layers}")
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise ScheduleFileError(path, str(exc),
                                format_programs(schedule, (exc.rank, exc.index))) from None
    return schedule


def pipeline_config(args: argparse.Namespace, world_size: int, vocab_size: int) -> PipelineConfig:
    """The whole run's typed configuration; raises ArgumentError before allocating."""
    if args.schedule_file is not None:
        schedule = load_schedule_file(args, world_size)
    else:
        schedule = generate_schedule(args, world_size, vocab_size)
        validate(schedule)  # generated schedules are valid by construction: prove it
    dtype = training_dtype(args)
    # Default threads: this process's share of the cores it may run on (affinity respected).
    local_procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    threads = args.cpu_optimizer_threads or max(1, len(usable_cores()) // local_procs)
    inject = None
    if args.inject_overflow is not None:
        iteration, stage, sub = args.inject_overflow
        inject = (iteration, BackwardStage(stage, sub))
    record = args.train_iters if (args.timeline or args.trace) else None
    return PipelineConfig(
        schedule=schedule,
        dtype=dtype,
        micro_batch_size=args.micro_batch_size,
        optimizer=OptimizerSettings(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                    eps=args.adam_eps, weight_decay=args.weight_decay,
                                    clip_grad=args.clip_grad, threads=threads,
                                    state_dtype=STATE_DTYPES[args.optimizer_state_dtype],
                                    master_dtype=STATE_DTYPES[args.master_dtype],
                                    stochastic_rounding=args.master_rounding == "stochastic",
                                    seed=args.seed),
        loss_scaling=LossScaling(args.initial_loss_scale, args.loss_scale_window,
                                 args.min_loss_scale) if dtype == torch.float16 else None,
        procs_per_node=args.procs_per_node,
        inject_overflow=inject,
        record_timeline_at=record,
        p2p_check=args.p2p_check,
        subgroups=subgroup_settings(args),
        data_parallel_size=args.data_parallel_size,
        zero_stage=args.zero_stage,
    )


def optimizer_bytes_per_param(args: argparse.Namespace) -> int:
    """Host bytes per parameter of the master and Adam's moments for the chosen
    --master-dtype and --optimizer-state-dtype (12, 10, 8 or 6)."""
    return state_bytes_per_param(STATE_DTYPES[args.master_dtype],
                                 STATE_DTYPES[args.optimizer_state_dtype])


def subgroup_settings(args: argparse.Namespace) -> SubgroupSettings | None:
    """--optimizer-gpu-stride / --optimizer-subgroup-size / --optimizer-gpu-resident-fraction
    (None: every update on the CPU)."""
    resident = args.optimizer_gpu_resident_fraction
    if args.optimizer_gpu_stride == 0 and resident == 0:
        return None
    return SubgroupSettings(stride=args.optimizer_gpu_stride, size=args.optimizer_subgroup_size,
                            cache_dir=args.data_cache_dir or default_cache_dir(),
                            resident_fraction=resident)


def args_for_schedule(base: argparse.Namespace, name: str) -> argparse.Namespace:
    """`base` with another schedule: the coupled baselines take their default split (1)."""
    args = copy.copy(base)
    args.pipeline_schedule = name
    if name != "decoupled":
        args.backward_split = None
    return args
