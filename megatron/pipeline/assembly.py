"""One rank's pipeline, assembled from a `PipelineConfig`, and one training step with it.

Each process builds only the modules of the backward stages it runs, creates the
shared-memory segments of the backward stages it owns (fp32 masters and Adam state stay in
its host memory, in the CPU optimizer), maps the others, and runs its program through the
`PipelineExecutor` every iteration.

`Pipeline.__init__` reads top to bottom in dependency order, each collaborator built
complete from those above it: modules; segments and their distribution to other nodes;
the gradient reduction between replicas; the optimizer groups and their owners; loss
scaling and the iteration's optimizer; the rank's buffers; the optimizer's device share
(sized from the gradient buffers); the executor; the checkpoint views.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.common.host_allocator import return_free_memory
from megatron.common.units import format_bytes
from megatron.config.placement import Interleaved, OnHost, Resident
from megatron.models.llama import Batch, LlamaConfig
from megatron.offload.device import get_device
from megatron.offload.param_store import ParameterStore
from megatron.offload.reaper_client import REAPER
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.disk_states import DiskStates, file_bytes, sweep_stale
from megatron.optimizer.group_optimizer import AsyncGroupOptimizer, IterationResult
from megatron.optimizer.loss_scaler import ConstantLossScaler, LossScaler
from megatron.optimizer.subgroups import plan_resident, plan_subgroups
from megatron.pipeline.buffers import rank_buffers
from megatron.pipeline.checkpoint_views import CheckpointViews, Views
from megatron.pipeline.config import LossScaling, PipelineConfig
from megatron.pipeline.data_parallel import ParallelLayout, create_host_groups
from megatron.pipeline.element_runs import group_element_runs
from megatron.pipeline.executor import PipelineExecutor
from megatron.pipeline.host_group import gloo_group, host_group
from megatron.pipeline.iteration_stats import pipeline_report
from megatron.pipeline.owner import BackwardStageOwner, OwnedStages
from megatron.pipeline.p2p import MessageShape, PointToPoint
from megatron.pipeline.replicas import (
    ParameterDistributor,
    global_replicas,
    holds_segment,
    transfer_events,
)
from megatron.pipeline.stage_modules import build_stage_modules, drop_parameters, initial_parameters
from megatron.pipeline.subgroup_device import (
    DeviceSubgroups,
    DeviceSubgroupUpdater,
    ResidentSubgroupUpdater,
)
from megatron.pipeline.zero import GradientReducer, publish_shards
from megatron.schedules.instructions import WHOLE_STAGE, BackwardStage, Op, Schedule
from megatron.schedules.lowering import forward_only_schedule
from megatron.schedules.replica_plan import plan_replicas
from megatron.schedules.subgroup_memory import default_subgroup_size, planned_subgroup_size
from megatron.schedules.timeline import TimedEvent


@dataclass
class StepReport:
    """One iteration of the whole pipeline, as every rank sees it."""

    loss: float  # mean over micro-batches, from the rank of the last forward stage
    result: IterationResult
    breakdown: dict  # mean and per-rank times (the metrics' pipeline fields)
    events: list[TimedEvent] = field(default_factory=list)  # every rank's, when recorded


class Pipeline:
    def __init__(self, config: PipelineConfig, model_cfg: LlamaConfig, rank: int) -> None:
        """`rank`: the global rank; the schedule's rank is its place in its pipeline."""
        self.config = config
        self.schedule = schedule = config.schedule
        self.eval_schedule = forward_only_schedule(schedule)  # for evaluation
        self.layout = layout = ParallelLayout(config.ranks, config.data_parallel_size, rank)
        self.rank = layout.pipeline_rank
        choice = config.device
        self.device = device = get_device(
            kind=choice.kind if choice else None, index=choice.index if choice else None,
            sanitize=config.device_sanitizer, chaos_seed=config.device_chaos)
        self.host_group = host_group()  # the whole world
        self.groups = create_host_groups(layout, self.host_group)
        # Uninitialized: the owned stages' initial weights are made one at a time below.
        self.modules = build_stage_modules(model_cfg, schedule.partition,
                                           schedule.backward_split,
                                           stages_used(schedule, self.rank), config.dtype,
                                           initialize=False)
        # A one-rank pipeline may run without a launcher: its segments are its own.
        job_id = f"process:{os.getpid()}" if layout.world_size == 1 else None
        self.store = ParameterStore(job_id=job_id, rank=rank, procs_per_node=config.procs_per_node)
        # The data-parallel replicas of a pipeline rank share its node (checked with the
        # flags), so nodes are whole pipeline ranks: plan there, then name global ranks.
        replicas = global_replicas(plan_replicas(
            schedule, max(1, self.store.procs_per_node // layout.data_parallel_size)),
            layout.global_rank)
        # Its own gloo group (made by every rank alike: the plan is the same everywhere).
        self.distributor = ParameterDistributor(
            replicas, self.store, rank, gloo_group() if replicas else None,
            thread_setup=device.bind_current_thread)
        self.reducer = None
        if layout.data_parallel_size > 1:
            self.reducer = GradientReducer(config.zero_stage, layout.data_parallel_size,
                                           layout.data_parallel_rank, self.groups.gradients,
                                           thread_setup=device.bind_current_thread)
        held = holds_segment(replicas, rank)  # replicas of stages owned on another node
        created = self._created_segments(held)
        masters = self._map_segments(model_cfg, created, held)
        self.cpu_adam, self.owned = self._optimizer_groups(masters, created)
        self.scaler = loss_scaler(config.loss_scaling)
        self.optimizer = AsyncGroupOptimizer(
            self.cpu_adam, self.scaler, clip_grad=config.optimizer.clip_grad,
            max_workers=max(1, min(4, self.cpu_adam.num_groups)),
            process_group=self._verdict_group(), thread_setup=device.bind_current_thread)
        self.buffers = rank_buffers(device, config.dtype, self.rank,
                                    {b: m.layout.numel for b, m in self.modules.items()},
                                    self.owned, (schedule, self.eval_schedule), config.report,
                                    config.host_gradient_dtype)
        self.subgroups = self._device_updates()
        # Each replica's backward divides by the replicas too: their sum is the mean.
        replica_count = layout.data_parallel_size
        self.executor = PipelineExecutor(
            schedule, self.rank, self.modules, self.store, device, self.buffers,
            self.optimizer, self.owned, self.subgroups, self._p2p(model_cfg),
            lambda: self.scaler.scale / replica_count, config.inject_overflow)
        self.views = CheckpointViews(self.owned, self.modules, self.cpu_adam, config.zero_stage,
                                     replica_count, self.groups.data_parallel)
        self.last_iteration = 0
        self.memory = self._host_memory()
        return_free_memory()  # what the construction freed (initial weights, modules)

    # --- assembly ----------------------------------------------------------------------

    def _created_segments(self, held: list[BackwardStage]) -> list[BackwardStage]:
        """The segments this process creates: its owned stages' and the replicas it holds
        for another node (one per stage per node: the first data-parallel replica's)."""
        if self.layout.data_parallel_rank != 0:
            return []
        return [*self.schedule.owned_by(self.rank), *held]

    def _map_segments(self, model_cfg: LlamaConfig, created: list[BackwardStage],
                      held: list[BackwardStage]) -> dict[BackwardStage, torch.Tensor]:
        """Create the owned stages' segments (filled, version 0) and the replicas held for
        other nodes, map the rest; return the owned stages' masters (in the optimizer's
        master dtype: it keeps them without a copy). One stage's initial weights exist at a
        time besides the masters."""
        dtype = self.config.dtype
        self.store.check_capacity({b: (self.modules[b].layout.numel, dtype) for b in created})
        masters = {}
        for b in self.schedule.owned_by(self.rank):
            module = self.modules[b]
            # the working copy starts from the master the optimizer will hold (bf16: rounded)
            master = initial_parameters(model_cfg, module).to(self.config.optimizer.master_dtype)
            if b in created:
                self.store.create(b, module.layout.numel, dtype).write(master, version=0)
            masters[b] = master
        for b in held:  # replicas of stages owned on another node
            self.store.create(b, self.modules[b].layout.numel, dtype)
        dist.barrier(group=self.host_group)  # every segment exists before anyone maps it
        self.distributor.distribute(0)
        for b in self.modules:
            if b not in created:
                self.store.attach(b, self.modules[b].layout.numel, dtype)
        # Parameters live in the device slots from now on: drop the construction copies.
        for module in self.modules.values():
            drop_parameters(module, self.device.torch_device)
        return masters

    def _optimizer_groups(self, masters: dict[BackwardStage, torch.Tensor],
                          created: list[BackwardStage]) -> tuple[CPUAdamW, OwnedStages]:
        """Two CPU AdamW groups per owned stage: decayed elements, then the others (with
        data parallelism, of this process's shard only)."""
        groups, mults, owners, runs = [], [], {}, []
        writes = self.layout.data_parallel_rank == 0 or self.config.zero_stage > 0
        for b, master in masters.items():
            module = self.modules[b]
            numel = module.layout.numel
            owner = BackwardStageOwner(
                b, numel, (len(groups), len(groups) + 1), module.decay_numel, self.store.get(b),
                shard=self.reducer.shard(numel) if self.reducer else None, reducer=self.reducer,
                writes_segment=writes, publishes=self.reducer is None)
            for (lo, hi), mult in zip(owner.bounds(), (1.0, 0.0)):
                groups.append(master[lo:hi] if hi > lo else torch.zeros(1))
                mults.append(mult)
                runs.append(group_element_runs(module, lo, hi))
            owners[b] = owner
        o = self.config.optimizer
        adam = CPUAdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                        threads=o.threads, weight_decay_mults=mults,
                        state_dtype=o.state_dtype, master_dtype=o.master_dtype,
                        stochastic_rounding=o.stochastic_rounding, rounding_seed=o.seed,
                        element_runs=runs, exact_rollback=o.exact_rollback,
                        disk=self._disk_states([g.numel() for g in groups]),
                        # the masters are its own, unless a shard of each is (ZeRO): then
                        # it copies its shard and the whole masters go
                        adopt=self.reducer is None)
        return adam, OwnedStages(owners)

    def _disk_states(self, numels: list[int]) -> DiskStates | None:
        """States on NVMe: this process's file, with a window of as many stages as the
        program holds read and not yet written at once."""
        path = self.config.placement.states.nvme_path
        if path is None:
            return None
        peak = self.config.report.peak_optimizer_states
        if not peak:
            raise ValueError("optimizer states on NVMe need a program with "
                             "READ/WRITE_OPTIMIZER_STATES")
        if self.rank == 0 and self.layout.data_parallel_rank == 0:
            for stale in sweep_stale(path):
                print(f"removed the optimizer state file of a finished job: {stale}", flush=True)
        dtypes = (self.config.optimizer.master_dtype, self.config.optimizer.state_dtype)
        disk = DiskStates(path, numels, *dtypes, window=max(1, peak[self.rank]),
                          job=self.store.job_id, rank=self.layout.global_rank(self.rank),
                          tracker=REAPER,
                          classes=[g % 2 for g in range(len(numels))],  # decayed, others
                          log=lambda line: print(f"rank {self.rank}: {line}", flush=True))
        print(f"rank {self.rank}: optimizer states on NVMe in {disk.path}: "
              f"{format_bytes(file_bytes(numels, *dtypes))} on disk, a window of "
              f"{max(1, peak[self.rank])} stage(s) in host memory "
              f"({format_bytes(disk.host_bytes)})", flush=True)
        return disk

    def _device_updates(self) -> DeviceSubgroups:
        """The placement's device share of the updates, executed (megatron/config/placement.py:
        a new placement adds its case here). The plan resolved --optimizer-gpu-stride auto
        into one of these before the pipeline was built."""
        match self.config.placement.updates:
            case OnHost():
                return DeviceSubgroups()
            case Interleaved(split_value=split):
                return self._interleaved_subgroups(split)
            case Resident(fraction=fraction):
                return DeviceSubgroups(0, self._resident_subgroups(fraction))
            case other:
                raise TypeError(f"the pipeline cannot execute the placement {other!r}")

    def _interleaved_subgroups(self, stride: int) -> DeviceSubgroups:
        """Split the groups of the stages this rank's program starts with
        OPTIMIZER_START_SUBGROUPS into subgroups placed by `stride` (every K-th, or all but
        every N-th, on the device), of the placement's size (the plan's, for auto) within
        what the gradient buffers hold, free once the backward has ended."""
        stages = sorted({BackwardStage(i.stage, i.sub) for i in self.schedule.programs[self.rank]
                         if i.op == Op.OPTIMIZER_START_SUBGROUPS})
        if not stages:
            return DeviceSubgroups()
        requested = self.config.placement.subgroup_size
        sizes = [hi - lo for b in stages for lo, hi in self.owned[b].bounds()]
        wanted = min(requested or default_subgroup_size(max(sizes)), max(sizes))
        budget = self.buffers.grad_buffers.nbytes
        size = planned_subgroup_size(requested, max(sizes), budget)
        if size < wanted:
            print(f"rank {self.rank}: optimizer subgroups of {wanted} parameters would need "
                  f"{DeviceSubgroupUpdater.bytes_needed(wanted)} bytes of device memory, more "
                  f"than the gradient buffers' {budget}: using {size}", flush=True)
        updater = DeviceSubgroupUpdater(self.device, size)
        for b in stages:
            owner = self.owned[b]
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    self.cpu_adam.set_subgroups(group, plan_subgroups(hi - lo, size, stride),
                                                updater)
        return DeviceSubgroups(stride, updater)

    def _resident_subgroups(self, fraction: float) -> ResidentSubgroupUpdater:
        """Twin-Flow: the first `fraction` of every owned group on the device."""
        updater = ResidentSubgroupUpdater(self.device)
        sizes = [hi - lo for owner in self.owned.values() for lo, hi in owner.bounds()]
        size = self.config.placement.subgroup_size or default_subgroup_size(max(sizes))
        for owner in self.owned.values():
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    self.cpu_adam.set_subgroups(
                        group, plan_resident(hi - lo, size, fraction), updater)
        return updater

    def _p2p(self, model_cfg: LlamaConfig) -> PointToPoint:
        shape = MessageShape((model_cfg.seq_length, self.config.micro_batch_size,
                              model_cfg.hidden_size), self.config.dtype)
        choice = self.config.device
        return PointToPoint(shape, self.device.torch_device, self.rank,
                            checked=self.config.p2p_check, peers=self.layout.pipeline_ranks(),
                            staged=bool(choice and choice.stages_transfers_through_host))

    def _verdict_group(self) -> dist.ProcessGroup | None:
        """Where the overflow flags and squared norms are summed: the whole world when
        the replicas split the gradient (each element counted once), one replica's
        pipeline when every replica holds all of it (ZeRO-0)."""
        if self.reducer is not None and self.config.zero_stage == 0:
            return self.groups.pipeline
        return self.host_group

    # --- one iteration -----------------------------------------------------------------

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float, record_timeline: bool | None = None) -> StepReport:
        """One iteration; its events gathered where `record_timeline` (None: at the
        configuration's record_timeline_at)."""
        self.cpu_adam.lr, self.cpu_adam.weight_decay = lr, weight_decay
        if record_timeline is None:
            record_timeline = iteration == self.config.record_timeline_at
        stats = self.executor.run_iteration(iteration, micro_batches,
                                            record_timeline=record_timeline)
        if self.reducer:  # every shard's corrections must be in before the publish
            self.optimizer.drain()
            self._publish_shards(iteration)
        # Each stage goes to the other nodes once published, while the next iteration runs.
        self.distributor.distribute(iteration)
        self.last_iteration = iteration
        loss, breakdown = pipeline_report(stats, self.rank, self.schedule.ranks,
                                          self.schedule.forward_rank[-1] == self.rank,
                                          self.groups.pipeline)
        if self.layout.data_parallel_size > 1:  # the loss of the global batch
            mean = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(mean, group=self.groups.data_parallel)
            loss = float(mean[0]) / self.layout.data_parallel_size
        breakdown.update(schedule=self.schedule.name, **{
            **self.memory, "host_gradient_pool_bytes": self.buffers.host_pool.allocated_bytes})
        transfers = self.distributor.take_transfers()  # the pushes during this iteration
        if stats.events:
            stats.events.extend(transfer_events(transfers, self.rank, stats.origin_host_s))
        events = self._gather_events(stats.events) if stats.events else []
        return StepReport(loss, stats.result, breakdown, events)

    def evaluate(self, batches: Sequence[Sequence[Batch]]) -> float:
        """Mean loss over every micro-batch of `batches` (one list per evaluation iteration)
        through the forward-only program, on the parameters of the last finished iteration;
        one host read and one all-reduce for the whole evaluation."""
        total = None
        for micro_batches in batches:
            loss_sum = self.executor.run_forward_only(self.eval_schedule, self.last_iteration,
                                                      micro_batches)
            if loss_sum is not None:
                total = loss_sum if total is None else total + loss_sum
        reduced = torch.tensor([self.device.read_scalar(total) if total is not None else 0.0],
                               dtype=torch.float64)
        dist.all_reduce(reduced, group=self.host_group)  # every replica's share
        return float(reduced[0]) / (len(batches) * self.schedule.micro_batches
                                    * self.layout.data_parallel_size)

    def _gather_events(self, events: list[TimedEvent]) -> list[TimedEvent]:
        gathered: list = [None] * self.schedule.ranks
        dist.all_gather_object(gathered, events, group=self.groups.pipeline)
        return [e for rank_events in gathered for e in rank_events]

    def _publish_shards(self, iteration: int, republish: bool = False) -> None:
        publish_shards([owner.segment for owner in self.owned.values()], iteration,
                       self.groups.data_parallel, first=self.layout.data_parallel_rank == 0,
                       republish=republish)

    # --- state -------------------------------------------------------------------------

    def checkpoint_views(self) -> Views:
        """Owned parameters by whole-model name: (master, exp_avg, exp_avg_sq), see
        CheckpointViews. Deferred corrections are finished first."""
        self.optimizer.drain()
        return self.views.views()

    def optimizer_step(self) -> int:
        """Adam's step count (every group steps together; skipped iterations do not count)."""
        return self.views.optimizer_step()

    def speculation(self) -> dict:
        """The scalars that decide the next iteration's speculative steps (see
        AsyncGroupOptimizer.state_dict): the same on every rank."""
        return self.optimizer.state_dict()

    def restored(self, optimizer_step: int, iteration: int,
                 speculation: dict | None = None) -> None:
        """After a checkpoint load overwrote `checkpoint_views()` in place: set the step
        count and the speculation state (None: a checkpoint without one, the first
        speculation assumes no clipping) and publish the new masters to the segments (and
        replicas)."""
        self.optimizer.drain()
        self.views.restore(optimizer_step)
        if speculation is not None:
            self.optimizer.load_state_dict(speculation)
        # --finetune restores at iteration 0, the version the segments were created with:
        # its weights replace version 0's before any process reads them (the barrier)
        republish = iteration == self.last_iteration
        self.last_iteration = iteration
        if self.reducer is None:
            for owner in self.owned.values():
                owner.segment.write(owner.master(self.cpu_adam), version=iteration,
                                    republish=republish)
        else:
            for owner in self.owned.values():
                if owner.writes_segment:
                    lo, hi = owner.shard
                    owner.segment.params[lo:hi].copy_(owner.master(self.cpu_adam))
            self._publish_shards(iteration, republish)
        self.distributor.distribute(iteration, republish)
        if republish:
            self.distributor.drain()
            dist.barrier(group=self.host_group)
        return_free_memory()  # what the load freed (the reader's buffers)

    def _host_memory(self) -> dict:
        """Host memory this process holds for the optimizer (fp32 master, m, v), what its
        gradient pool will hold (one buffer per owned stage: `step` reports what it does
        hold), the shared memory of the segments per node, and what a process page-locks on
        CUDA (the segments it maps and its gradient pool: against ulimit -l) (max over
        processes and nodes). Collective."""
        state = self.cpu_adam.host_state_bytes()
        nodes = -(-self.layout.world_size // self.store.procs_per_node)
        table = torch.zeros(nodes + 2, dtype=torch.float64)
        table[self.store.node] = sum(seg.params.nbytes for seg in self.store.created())
        table[nodes] = state
        table[nodes + 1] = self.store.mapped_bytes() + self.buffers.host_pool.capacity_bytes
        maxima = table.clone()
        dist.all_reduce(table, group=self.host_group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.host_group)
        return {"host_optimizer_state_bytes": int(maxima[nodes]),
                "host_gradient_pool_bytes": self.buffers.host_pool.capacity_bytes,
                "shared_memory_bytes_per_node": int(table[:nodes].max()),
                "pinned_bytes_per_process": int(maxima[nodes + 1])}

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
        try:
            self.optimizer.close()  # the last corrections publish their stages
        finally:
            if self.cpu_adam.disk is not None:  # after the last corrections wrote
                self.cpu_adam.disk.close()
        self.distributor.close()
        # the copies still queued (after a failed instruction) read the segments: drain
        # them before the segments are unmapped, or a copy thread reads unmapped memory
        self.device.close()
        self.store.close()


def stages_used(schedule: Schedule, rank: int) -> set[BackwardStage]:
    """The backward stages whose modules `rank` runs: those of its forward stages and
    those it owns."""
    used = {b for i in range(schedule.forward_stages) if schedule.forward_rank[i] == rank
            for b in schedule.params_of(i, WHOLE_STAGE)}
    return used | set(schedule.owned_by(rank))


def loss_scaler(scaling: LossScaling | None) -> LossScaler:
    """fp16's (static or dynamic), a constant 1 otherwise."""
    return ConstantLossScaler() if scaling is None else scaling.build()
