"""The pipeline as the training loop's TrainStep: configuration, setup, one iteration.

Each process builds only the modules of the stages it runs, creates the shared-memory
segments of the backward stages it owns (fp32 masters and Adam state stay in its host
memory, in the CPU optimizer), maps the others, and runs its instruction list through
`PipelineExecutor` every iteration.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron.models.llama import Batch, LlamaConfig
from megatron.models.presets import ModelPreset
from megatron.offload.device import get_device
from megatron.offload.grad_offload import GradientOffloader
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.layout import copy_parameters_into
from megatron.offload.param_store import ParameterStore
from megatron.offload.prefetch import ParamDoubleBuffer
from megatron.optimizer.async_optimizer import AsyncStageOptimizer
from megatron.optimizer.cpu_adam import CPUAdamW, usable_cores
from megatron.optimizer.loss_scaler import ConstantLossScaler
from megatron.pipeline.executor import IterationStats, OwnedStage, PipelineExecutor
from megatron.pipeline.p2p import MessageShape, PointToPoint
from megatron.pipeline.replicas import holds_segment, plan_replicas, push_replicas
from megatron.pipeline.stage_modules import StageModule, build_stage_modules, piece_numels
from megatron.schedules.cost_model import (
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
)
from megatron.schedules.generators import build_schedule
from megatron.schedules.instructions import Piece, Schedule
from megatron.schedules.partition import balanced_partition
from megatron.schedules.validator import validate
from megatron.training.arguments import ArgumentError
from megatron.training.distributed import cpu_process_group
from megatron.training.training import StepResult, make_loss_scaler, training_dtype

ONE_STAGE_PER_RANK = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str
    ranks: int
    forward_stages: int
    backward_split: int
    micro_batches: int
    partition: tuple[int, ...]


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
    if args.num_layers < min_layers * forward_stages:
        raise ArgumentError("--backward-split", min_layers,
                            f"needs {min_layers} layers in each of {forward_stages} forward "
                            f"stages, the model has {args.num_layers}")
    model = ModelPreset("custom", args.num_layers, args.hidden_size, args.ffn_hidden_size,
                        args.num_attention_heads, args.num_query_groups, args.seq_length,
                        vocab_size)
    # Give every stage (min_layers - 1) layers up front, balance the rest by forward flops
    # (the simulator's cost model): the fixed part is the same for all stages, so the
    # balance is kept.
    fixed = min_layers - 1
    rest = balanced_partition(args.num_layers - fixed * forward_stages, forward_stages,
                              layer_cost=layer_forward_flops_per_token(model, args.seq_length),
                              embedding_cost=0.0, head_cost=head_forward_flops_per_token(model))
    return tuple(fixed + n for n in rest)


def resolve_pipeline(args: argparse.Namespace, world_size: int, vocab_size: int) -> PipelineConfig:
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
    micro_batches = args.global_batch_size // args.micro_batch_size
    config = PipelineConfig(name, world_size, stages, split, micro_batches, partition)
    try:
        build_pipeline_schedule(config)
    except ValueError as exc:
        flag = "--backward-split" if "split" in str(exc) else "--forward-stages"
        raise ArgumentError(flag, split if flag == "--backward-split" else stages, str(exc)) from None
    return config


# Backward (with its recompute) over forward time: where the schedule places its blocking
# transfers. Recomputation makes a backward about three forwards.
BACKWARD_RATIO = 3.0


def build_pipeline_schedule(c: PipelineConfig) -> Schedule:
    return build_schedule(c.schedule, c.ranks, c.forward_stages, c.backward_split,
                          c.micro_batches, c.partition, backward_ratio=BACKWARD_RATIO)


class PipelineTrainStep:
    def __init__(self, model_cfg: LlamaConfig, args: argparse.Namespace, dist_info) -> None:
        self.rank = dist_info.rank
        self.config = resolve_pipeline(args, dist_info.world_size, model_cfg.vocab_size)
        c = self.config
        self.schedule: Schedule = build_pipeline_schedule(c)
        report = validate(self.schedule)
        self.dtype = training_dtype(args)
        self.device = get_device()
        rank = self.rank
        forward_pieces = [(i, k) for i in range(c.forward_stages)
                          if self.schedule.forward_rank[i] == rank for k in range(c.backward_split)]
        owned = self.schedule.owned_pieces(rank)
        self.modules = build_stage_modules(model_cfg, c.partition, c.backward_split,
                                           forward_pieces + owned, self.dtype)
        self.cpu_group = cpu_process_group()
        self.store = ParameterStore(rank=rank, procs_per_node=args.procs_per_node)
        self.replicas = plan_replicas(self.schedule, self.store.procs_per_node)
        held = holds_segment(self.replicas, rank)
        created = [*owned, *held]
        self.store.check_capacity({p: (self.modules[p].layout.numel, self.dtype) for p in created})
        masters = self._create_owned_segments(owned)
        for piece in held:  # replicas of stages owned on another node
            self.store.create(piece, self.modules[piece].layout.numel, self.dtype)
        dist.barrier()  # every segment exists before anyone maps it
        push_replicas(self.replicas, self.store, rank, self.cpu_group)
        for piece in self.modules:
            if piece not in created:
                self.store.attach(piece, self.modules[piece].layout.numel, self.dtype)
        self._free_module_storage()

        groups, mults, self.owned = [], [], {}
        for piece in owned:
            stage = self.modules[piece]
            ids = []
            for lo, hi, mult in ((0, stage.decay_numel, 1.0),
                                 (stage.decay_numel, stage.layout.numel, 0.0)):
                ids.append(len(groups))
                groups.append(masters[piece][lo:hi] if hi > lo else torch.zeros(1))
                mults.append(mult)
            grad = self.device.zeros(stage.layout.numel, self.dtype)
            self.owned[piece] = OwnedStage(grad, tuple(ids), stage.decay_numel)
        # Default: this process's share of the cores it may run on (affinity respected).
        threads = args.cpu_optimizer_threads or max(1, len(usable_cores()) // max(
            1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        self.cpu_adam = CPUAdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_eps, weight_decay=args.weight_decay,
                                 threads=threads, weight_decay_mults=mults)
        self.scaler = make_loss_scaler(args) if self.dtype == torch.float16 else ConstantLossScaler()
        self.optimizer = AsyncStageOptimizer(
            self.cpu_adam, self.scaler,
            mode="async" if c.schedule == "decoupled" else "sync",
            clip_grad=args.clip_grad, max_workers=max(1, min(4, len(groups))),
            process_group=self.cpu_group)
        slot_numel = max(m.layout.numel for m in self.modules.values())
        slots = max(2, report.peak_params[rank])
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.param_buffer = ParamDoubleBuffer(self.device, slots * slot_numel * itemsize,
                                              self.dtype, slots=slots)
        self.host_pool = HostBufferPool(  # every owned stage's gradients, fp32 at most
            self.device, sum(4 * self.modules[p].layout.numel for p in owned) or 1)
        self.offloader = GradientOffloader(self.device, self.host_pool, training_dtype=self.dtype)
        shape = MessageShape((model_cfg.seq_length, args.micro_batch_size, model_cfg.hidden_size),
                             self.dtype)
        p2p = PointToPoint(shape, c.forward_stages, c.backward_split, c.micro_batches,
                           self.device.torch_device)
        inject = None
        if args.inject_overflow is not None:
            inject = (args.inject_overflow[0], tuple(args.inject_overflow[1:]))
        self.executor = PipelineExecutor(
            self.schedule, rank, self.modules, self.store, self.device, self.param_buffer,
            self.offloader, self.optimizer, self.owned, p2p, lambda: self.scaler.scale, inject)
        keep = args.timeline or args.trace or getattr(args, "keep_timeline", False)
        self.timeline_iteration = args.train_iters if keep else None
        self.timeline_paths = (args.timeline, args.trace)
        self.last_events_all_ranks: list = []  # the recorded iteration, every rank's events
        self.piece_numels = piece_numels(model_cfg, c.partition, c.backward_split)
        self.last_iteration = 0

    # --- setup helpers -----------------------------------------------------------------

    def _create_owned_segments(self, owned: Sequence[Piece]) -> dict[Piece, torch.Tensor]:
        """Create and fill the owned stages' segments (version 0); return fp32 masters."""
        masters = {}
        for piece in owned:
            stage = self.modules[piece]
            master = torch.empty(stage.layout.numel, dtype=torch.float32)
            copy_parameters_into(stage.module, replace(stage.layout, dtype=torch.float32), master)
            segment = self.store.create(piece, stage.layout.numel, self.dtype)
            segment.write(master, version=0)
            masters[piece] = master
        return masters

    def _free_module_storage(self) -> None:
        """Parameters live in the device buffer from now on: drop the construction copies."""
        for stage in self.modules.values():
            for param in stage.module.parameters():
                param.data = torch.empty(0, dtype=self.dtype, device=self.device.torch_device)

    # --- TrainStep -------------------------------------------------------------------

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult:
        self.cpu_adam.lr, self.cpu_adam.weight_decay = lr, weight_decay
        batches = [{k: v.to(self.device.torch_device) for k, v in b.items()} for b in micro_batches]
        stats = self.executor.run_iteration(iteration, batches,
                                            record_timeline=iteration == self.timeline_iteration)
        push_replicas(self.replicas, self.store, self.rank, self.cpu_group)
        self.last_iteration = iteration
        extra = self._breakdown(stats)
        if stats.events:
            self._write_timeline(stats)
        r = stats.result
        return StepResult(extra.pop("loss"), skipped=r.skipped, grad_norm=r.grad_norm,
                          loss_scale=r.loss_scale if self.dtype == torch.float16 else None,
                          extra=extra)

    def _breakdown(self, stats: IterationStats) -> dict:
        """All-reduce the loss (from the last forward stage's rank) and per-rank times."""
        world = self.config.ranks
        has_loss = self.schedule.forward_rank[-1] == self.rank
        table = torch.zeros(world + 1, 4, dtype=torch.float64)
        table[self.rank] = torch.tensor([stats.compute_s, stats.bubble_s,
                                         stats.exposed_optimizer_s, stats.iteration_s])
        table[world, 0] = stats.loss if has_loss else 0.0
        dist.all_reduce(table, group=self.cpu_group)
        per_rank = [{"rank": r, "gpu_time_s": float(table[r, 0]), "bubble_time_s": float(table[r, 1]),
                     "exposed_optimizer_time_s": float(table[r, 2])} for r in range(world)]
        means = table[:world].mean(dim=0)
        return {
            "loss": float(table[world, 0]),
            "gpu_time_s": float(means[0]),
            "bubble_time_s": float(means[1]),
            "exposed_optimizer_time_s": float(means[2]),
            # S Eq. 1-3 (as the simulator): the share of the iteration a GPU is not computing.
            "bubble_ratio": float((1 - table[:world, 0] / table[:world, 3]).mean()),
            "per_rank": per_rank,
            "schedule": self.config.schedule,
        }

    def _write_timeline(self, stats: IterationStats) -> None:
        from megatron.schedules.timeline import write_chrome_trace, write_timeline_png

        gathered: list = [None] * self.config.ranks
        dist.all_gather_object(gathered, stats.events, group=self.cpu_group)
        events = [e for rank_events in gathered for e in rank_events]
        self.last_events_all_ranks = events
        png, trace = self.timeline_paths
        if self.rank != 0:
            return
        c = self.config
        title = (f"measured: {c.schedule}, {c.ranks} ranks, {c.forward_stages} forward stages, "
                 f"d={c.backward_split}, {c.micro_batches} micro-batches")
        if png:
            write_timeline_png(events, png, title=title)
        if trace:
            write_chrome_trace(events, trace)

    def _working_master(self, piece: Piece) -> torch.Tensor:
        """The stage's fp32 masters in layout order (its two optimizer groups, joined)."""
        numel = self.modules[piece].layout.numel
        return torch.cat([self.cpu_adam.master(g) for g in self.owned[piece].groups])[:numel]

    def state_dict(self) -> dict:
        """fp32 masters by whole-model parameter name (the one-process checkpoint's names),
        plus the owned stages' Adam moments."""
        model = {}
        for piece in self.owned:
            stage = self.modules[piece]
            flat = self._working_master(piece)
            for name, view in zip(stage.model_names(), _views(stage, flat)):
                model[name] = view.clone()
        optimizer = self.cpu_adam.state_dict()
        return {
            "pipeline": vars(self.config),
            "iteration": self.last_iteration,
            "model": model,
            "optimizer": [{"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone(),
                           "step": s["step"]} for s in optimizer["stages"]],
            "loss_scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        from megatron.training.checkpointing import CheckpointError

        if state.get("pipeline") != vars(self.config):
            raise CheckpointError(f"checkpoint was saved with pipeline {state.get('pipeline')}, "
                                  f"this run uses {vars(self.config)}")
        stages = []
        for piece, owned in self.owned.items():
            stage = self.modules[piece]
            flat = torch.empty(stage.layout.numel, dtype=torch.float32)
            for name, view in zip(stage.model_names(), _views(stage, flat)):
                view.copy_(state["model"][name])
            for group, (lo, hi) in zip(owned.groups, ((0, owned.split), (owned.split, flat.numel()))):
                moments = state["optimizer"][group]
                stages.append((group, {"master": flat[lo:hi] if hi > lo else torch.zeros(1),
                                       **moments}))
        self.cpu_adam.load_state_dict({"stages": [s for _, s in sorted(stages, key=lambda x: x[0])]})
        self.scaler.load_state_dict(state["loss_scaler"])
        self.last_iteration = int(state["iteration"])
        for piece in self.owned:
            self.store.get(piece).write(self._working_master(piece), version=self.last_iteration)
        push_replicas(self.replicas, self.store, self.rank, self.cpu_group)

    def close(self) -> None:
        self.optimizer.close()
        self.store.close()
        self.device.close()


def _views(stage: StageModule, flat: torch.Tensor) -> list[torch.Tensor]:
    """Per-parameter views of an fp32 flat buffer laid out like the stage."""
    return replace(stage.layout, dtype=flat.dtype).views(flat)
