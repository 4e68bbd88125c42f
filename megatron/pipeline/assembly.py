"""One rank's pipeline, assembled from a `PipelineConfig`, and one training step with it.

Each process builds only the modules of the backward stages it runs, creates the
shared-memory segments of the backward stages it owns (fp32 masters and Adam state stay in
its host memory, in the CPU optimizer), maps the others, and runs its program through the
`PipelineExecutor` every iteration.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from megatron.models.llama import Batch, LlamaConfig
from megatron.offload.device import MEMORY_CATEGORIES, get_device
from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.layout import copy_parameters_into
from megatron.offload.param_store import ParameterStore
from megatron.offload.prefetch import ParamSlots
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.group_optimizer import AsyncGroupOptimizer, IterationResult
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from megatron.optimizer.subgroups import plan_resident, plan_subgroups
from megatron.pipeline.config import PipelineConfig, SubgroupSettings
from megatron.pipeline.data_parallel import ParallelLayout, create_host_groups
from megatron.pipeline.element_runs import group_element_runs
from megatron.pipeline.executor import IterationStats, PipelineExecutor
from megatron.pipeline.host_group import host_group
from megatron.pipeline.optimizer_calibration import calibrated_update_rates
from megatron.pipeline.owner import BackwardStageOwner
from megatron.pipeline.p2p import MessageShape, PointToPoint
from megatron.pipeline.replicas import (
    ParameterDistributor,
    global_replicas,
    holds_segment,
    transfer_events,
)
from megatron.pipeline.stage_modules import build_stage_modules
from megatron.pipeline.subgroup_device import DeviceSubgroupUpdater, ResidentSubgroupUpdater
from megatron.pipeline.zero import GradientReducer
from megatron.schedules.instructions import WHOLE_STAGE, BackwardStage, Op
from megatron.schedules.lowering import forward_only_schedule
from megatron.schedules.optimizer_stride import gpu_update_stride
from megatron.schedules.replica_plan import plan_replicas
from megatron.schedules.subgroup_memory import default_subgroup_size, planned_subgroup_size
from megatron.schedules.timeline import TimedEvent
from megatron.schedules.validator import validate


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
        self.layout = ParallelLayout(config.ranks, config.data_parallel_size, rank)
        self.global_rank = rank
        self.rank = self.layout.pipeline_rank
        self.schedule = config.schedule
        self.eval_schedule = forward_only_schedule(self.schedule)  # for evaluation
        self.dtype = config.dtype
        self.device = get_device()
        self.host_group = host_group()  # the whole world
        self.groups = create_host_groups(self.layout, self.host_group)
        rank = self.rank
        needed = {b for i in range(self.schedule.forward_stages)
                  if self.schedule.forward_rank[i] == rank
                  for b in self.schedule.params_of(i, WHOLE_STAGE)}
        needed.update(self.schedule.owned_by(rank))
        self.modules = build_stage_modules(model_cfg, self.schedule.partition,
                                           self.schedule.backward_split, needed, self.dtype)
        # A one-rank pipeline may run without a launcher: its segments are its own.
        job_id = f"process:{os.getpid()}" if self.layout.world_size == 1 else None
        self.store = ParameterStore(job_id=job_id, rank=self.global_rank,
                                    procs_per_node=config.procs_per_node)
        # The data-parallel replicas of a pipeline rank share its node (checked with the
        # flags), so nodes are whole pipeline ranks: plan there, then name global ranks.
        d = self.layout.data_parallel_size
        self.replicas = global_replicas(
            plan_replicas(self.schedule, max(1, self.store.procs_per_node // d)),
            self.layout.global_rank)
        # Its own gloo group (made by every rank alike: the plan is the same everywhere).
        self.distributor = ParameterDistributor(
            self.replicas, self.store, self.global_rank,
            dist.new_group(backend="gloo") if self.replicas else None,
            thread_setup=self.device.bind_current_thread)
        self.reducer = None
        if d > 1:
            self.reducer = GradientReducer(config.zero_stage, d, self.layout.data_parallel_rank,
                                           self.groups.gradients,
                                           thread_setup=self.device.bind_current_thread)
        masters = self._map_segments()
        self.cpu_adam, self.owners = self._optimizer_groups(masters)
        self._gathered: dict[BackwardStage, tuple[torch.Tensor, ...]] = {}
        self.scaler: LossScaler = ConstantLossScaler()
        if config.loss_scaling is not None:
            s = config.loss_scaling
            self.scaler = DynamicLossScaler(s.initial_scale, growth_interval=s.growth_interval,
                                            min_scale=s.min_scale)
        self.optimizer = AsyncGroupOptimizer(
            self.cpu_adam, self.scaler, clip_grad=config.optimizer.clip_grad,
            max_workers=max(1, min(4, self.cpu_adam.num_groups)),
            process_group=self._verdict_group(), thread_setup=self.device.bind_current_thread)
        self.executor = self._executor(model_cfg)
        self.gpu_stride, self.subgroup_updater = self._plan_subgroups()
        self.executor.subgroup_updater = self.subgroup_updater
        self.last_iteration = 0
        self.memory = self._host_memory()

    # --- assembly ----------------------------------------------------------------------

    def _map_segments(self) -> dict[BackwardStage, torch.Tensor]:
        """Create the owned stages' segments (filled, version 0) and the replicas held for
        other nodes, map the rest; return the owned stages' fp32 masters."""
        owned = self.schedule.owned_by(self.rank)
        held = holds_segment(self.replicas, self.global_rank)
        # One segment per stage per node: the first data-parallel replica creates it.
        created = [*owned, *held] if self.layout.data_parallel_rank == 0 else []
        self.store.check_capacity({b: (self.modules[b].layout.numel, self.dtype) for b in created})
        masters = {}
        for b in owned:
            module = self.modules[b]
            master = torch.empty(module.layout.numel, dtype=torch.float32)
            copy_parameters_into(module.module, replace(module.layout, dtype=torch.float32),
                                 master)
            # the working copy starts from the master the optimizer will hold (bf16: rounded)
            master.copy_(master.to(self.config.optimizer.master_dtype))
            if b in created:
                self.store.create(b, module.layout.numel, self.dtype).write(master, version=0)
            masters[b] = master
        for b in held:  # replicas of stages owned on another node
            self.store.create(b, self.modules[b].layout.numel, self.dtype)
        dist.barrier(group=self.host_group)  # every segment exists before anyone maps it
        self.distributor.distribute(0)
        for b in self.modules:
            if b not in created:
                self.store.attach(b, self.modules[b].layout.numel, self.dtype)
        # Parameters live in the device slots from now on: drop the construction copies.
        for module in self.modules.values():
            for param in module.module.parameters():
                param.data = torch.empty(0, dtype=self.dtype, device=self.device.torch_device)
        return masters

    def _optimizer_groups(self, masters: dict[BackwardStage, torch.Tensor]
                          ) -> tuple[CPUAdamW, dict[BackwardStage, BackwardStageOwner]]:
        """Two CPU AdamW groups per owned stage: decayed elements, then the others (with
        data parallelism, of this process's shard only)."""
        groups, mults, owners, runs = [], [], {}, []
        first = self.layout.data_parallel_rank == 0
        for b, master in masters.items():
            module = self.modules[b]
            numel = module.layout.numel
            owner = BackwardStageOwner(
                b, numel, (len(groups), len(groups) + 1), module.decay_numel, self.store.get(b),
                shard=self.reducer.shard(numel) if self.reducer else None, reducer=self.reducer,
                writes_segment=first or self.config.zero_stage > 0,
                publishes=self.reducer is None)
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
                        element_runs=runs)
        return adam, owners

    def _plan_subgroups(self) -> tuple[int, DeviceSubgroupUpdater | ResidentSubgroupUpdater | None]:
        """Split the groups of the stages this rank's program starts with
        OPTIMIZER_START_SUBGROUPS into subgroups, every k-th updated on the device (k from
        the flag, or Eq. 1 over the calibrated rates). Returns (k, the device updater)."""
        settings = self.config.subgroups
        if settings is not None and settings.resident_fraction > 0:
            return 0, self._plan_resident(settings)
        stages = sorted({BackwardStage(i.stage, i.sub) for i in self.schedule.programs[self.rank]
                         if i.op == Op.OPTIMIZER_START_SUBGROUPS})
        if settings is None or not stages:
            return 0, None
        stride = settings.stride
        if stride is None:
            rates = calibrated_update_rates(
                self.device, self.cpu_adam.threads, settings.cache_dir,
                log=lambda line: print(f"rank {self.rank}: {line}", flush=True))
            model = gpu_update_stride(rates)
            stride = model.k
            print(f"rank {self.rank}: optimizer GPU stride k = {stride} (Eq. 1: "
                  f"{model.k_real:.3g}) for stages {[tuple(b) for b in stages]}", flush=True)
        if stride == 0:
            return 0, None
        sizes = [hi - lo for b in stages for lo, hi in self.owners[b].bounds()]
        wanted = min(settings.size or default_subgroup_size(max(sizes)), max(sizes))
        # The budget: what the gradient buffers hold, free once the backward has ended.
        budget = self.grad_buffers.nbytes
        size = planned_subgroup_size(settings.size, max(sizes), budget)
        if size < wanted:
            print(f"rank {self.rank}: optimizer subgroups of {wanted} parameters would need "
                  f"{DeviceSubgroupUpdater.bytes_needed(wanted)} bytes of device memory, more "
                  f"than the gradient buffers' {budget}: using {size}", flush=True)
        updater = DeviceSubgroupUpdater(self.device, size)
        for b in stages:
            owner = self.owners[b]
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    self.cpu_adam.set_subgroups(group, plan_subgroups(hi - lo, size, stride),
                                                updater)
        return stride, updater

    def _plan_resident(self, settings: SubgroupSettings) -> ResidentSubgroupUpdater:
        """Twin-Flow: the first `resident_fraction` of every owned group on the device."""
        updater = ResidentSubgroupUpdater(self.device)
        sizes = [hi - lo for owner in self.owners.values() for lo, hi in owner.bounds()]
        size = settings.size or default_subgroup_size(max(sizes))
        for owner in self.owners.values():
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    self.cpu_adam.set_subgroups(
                        group, plan_resident(hi - lo, size, settings.resident_fraction), updater)
        return updater

    def _executor(self, model_cfg: LlamaConfig) -> PipelineExecutor:
        s = self.schedule
        slot_numel = max(m.layout.numel for m in self.modules.values())
        report = validate(s)
        slots = max(2, report.peak_params[self.rank],
                    validate(self.eval_schedule).peak_params[self.rank])
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.param_slots = ParamSlots(self.device, slots * slot_numel * itemsize, self.dtype,
                                      slots=slots)
        self.host_pool = HostBufferPool(  # every owned stage's gradients, fp32 at most
            self.device, sum(4 * owner.numel for owner in self.owners.values()) or 1)
        offloader = GradientOffloader(self.device, self.host_pool, training_dtype=self.dtype)
        # Gradient buffers for the backward stages in flight at once, plus one so the next
        # stage starts while the previous one's offload copy runs.
        largest = max((owner.numel for owner in self.owners.values()), default=1)
        in_flight = report.peak_gradients[self.rank]
        self.grad_buffers = GradientBuffers(self.device, largest, self.dtype,
                                            min(in_flight + 1, max(1, len(self.owners))))
        shape = MessageShape((model_cfg.seq_length, self.config.micro_batch_size,
                              model_cfg.hidden_size), self.dtype)
        p2p = PointToPoint(shape, self.device.torch_device, self.rank,
                           checked=self.config.p2p_check, peers=self.layout.pipeline_ranks())
        # Each replica's backward divides by the replicas too: their sum is the mean.
        replicas = self.layout.data_parallel_size
        return PipelineExecutor(s, self.rank, self.modules, self.store, self.device,
                                self.param_slots, offloader, self.grad_buffers, self.optimizer,
                                self.owners, p2p,
                                lambda: self.scaler.scale / replicas, self.config.inject_overflow)

    # --- one iteration -----------------------------------------------------------------

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepReport:
        self.cpu_adam.lr, self.cpu_adam.weight_decay = lr, weight_decay
        batches = [{k: v.to(self.device.torch_device) for k, v in b.items()} for b in micro_batches]
        stats = self.executor.run_iteration(
            iteration, batches, record_timeline=iteration == self.config.record_timeline_at)
        if self.reducer:  # every shard's corrections must be in before the publish
            self.optimizer.drain()
            self._publish_shards(iteration)
        # Each stage goes to the other nodes once published, while the next iteration runs.
        self.distributor.distribute(iteration)
        self.last_iteration = iteration
        loss, breakdown = self._breakdown(stats)
        transfers = self.distributor.take_transfers()  # the pushes during this iteration
        if stats.events:
            stats.events.extend(transfer_events(transfers, self.rank, stats.origin_host_s))
        events = self._gather_events(stats) if stats.events else []
        return StepReport(loss, stats.result, breakdown, events)

    def evaluate(self, batches: Sequence[Sequence[Batch]]) -> float:
        """Mean loss over every micro-batch of `batches` (one list per evaluation iteration)
        through the forward-only program, on the parameters of the last finished iteration;
        one host read and one all-reduce for the whole evaluation."""
        total = None
        for micro_batches in batches:
            moved = [{k: v.to(self.device.torch_device) for k, v in b.items()}
                     for b in micro_batches]
            loss_sum = self.executor.run_forward_only(self.eval_schedule, self.last_iteration,
                                                      moved)
            if loss_sum is not None:
                total = loss_sum if total is None else total + loss_sum
        reduced = torch.tensor([self.device.read_scalar(total) if total is not None else 0.0],
                               dtype=torch.float64)
        dist.all_reduce(reduced, group=self.host_group)  # every replica's share
        return float(reduced[0]) / (len(batches) * self.schedule.micro_batches
                                    * self.layout.data_parallel_size)

    def _breakdown(self, stats: IterationStats) -> tuple[float, dict]:
        """All-reduce the loss (from the last forward stage's rank) and per-rank figures."""
        world = self.schedule.ranks
        has_loss = self.schedule.forward_rank[-1] == self.rank
        extra = 6 + len(MEMORY_CATEGORIES)  # columns after the memory categories
        table = torch.zeros(world + 1, extra + 3, dtype=torch.float64)
        table[self.rank] = torch.tensor(
            [stats.compute_s, stats.bubble_s, stats.exposed_optimizer_s, stats.iteration_s,
             stats.host_syncs, stats.memory_peak_bytes]
            + [stats.memory_breakdown[name] for name in MEMORY_CATEGORIES]
            + [stats.clip_corrections_exposed_s, stats.exposed_optimizer_device_s,
               self.gpu_stride])
        table[world, 0] = stats.loss if has_loss else 0.0
        dist.all_reduce(table, group=self.groups.pipeline)
        if self.layout.data_parallel_size > 1:  # the loss of the global batch
            loss = table[world, :1].clone()
            dist.all_reduce(loss, group=self.groups.data_parallel)
            table[world, 0] = loss[0] / self.layout.data_parallel_size
        per_rank = [{"rank": r, "gpu_time_s": float(table[r, 0]),
                     "bubble_time_s": float(table[r, 1]),
                     "exposed_optimizer_time_s": float(table[r, 2]),
                     "host_syncs": int(table[r, 4]),
                     "device_memory_peak_bytes": int(table[r, 5]),
                     "device_memory_at_peak": {name: int(table[r, 6 + i])
                                               for i, name in enumerate(MEMORY_CATEGORIES)}}
                    for r in range(world)]
        means = table[:world].mean(dim=0)
        return float(table[world, 0]), {
            "gpu_time_s": float(means[0]),
            "bubble_time_s": float(means[1]),
            "exposed_optimizer_time_s": float(means[2]),
            # S Eq. 1-3 (as the simulator): the share of the iteration a GPU is not computing.
            "bubble_ratio": float((1 - table[:world, 0] / table[:world, 3]).mean()),
            "host_syncs": int(table[:world, 4].max()),  # the worst rank's
            "device_memory_peak_bytes": int(table[:world, 5].max()),
            "per_rank": per_rank,
            "schedule": self.schedule.name,
            # of exposed_optimizer_time_s: waits for clipping corrections / rollbacks
            "clip_corrections_exposed_s": float(means[extra]),
            # of exposed_optimizer_time_s: on the device (subgroups still flushing after the
            # CPU's part was done) and the rest, on the CPU
            "exposed_optimizer_device_time_s": float(means[extra + 1]),
            "exposed_optimizer_cpu_time_s": float(means[2] - means[extra + 1]),
            "optimizer_gpu_stride": int(table[:world, extra + 2].max()),
            **self.memory,
        }

    def _gather_events(self, stats: IterationStats) -> list[TimedEvent]:
        gathered: list = [None] * self.schedule.ranks
        dist.all_gather_object(gathered, stats.events, group=self.groups.pipeline)
        return [e for rank_events in gathered for e in rank_events]

    # --- state -------------------------------------------------------------------------

    def checkpoint_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Owned parameters by whole-model name (LlamaModel's): live views of the
        master, exp_avg and exp_avg_sq (fp32 or bf16, as the optimizer keeps them) inside the CPU optimizer (no copy). A parameter lies
        in one of its stage's two groups (decayed elements first, then the others).
        Deferred corrections are finished first, and master()/exp_avg() bring subgroups
        kept on the device back to the host."""
        self.optimizer.drain()
        if self.reducer is not None:
            return self._gathered_views()
        adam, out = self.cpu_adam, {}
        for b, owner in self.owners.items():
            module = self.modules[b]
            for s, name in zip(module.layout.slices, module.model_names()):
                group, offset = ((owner.groups[0], s.offset) if s.offset < owner.split
                                 else (owner.groups[1], s.offset - owner.split))
                out[name] = tuple(buf[offset:offset + s.numel].view(s.shape)
                                  for buf in (adam.master(group), adam.exp_avg(group),
                                              adam.exp_avg_sq(group)))
        return out

    def _stepped_groups(self) -> list[int]:
        """Groups that hold elements (an empty group is a placeholder that never steps)."""
        return [g for owner in self.owners.values()
                for g, (lo, hi) in zip(owner.groups, owner.bounds()) if hi > lo]

    def optimizer_step(self) -> int:
        """Adam's step count (every group steps together; skipped iterations do not count)."""
        return max((self.cpu_adam.step_count(g) for g in self._stepped_groups()), default=0)

    def restored(self, optimizer_step: int, iteration: int) -> None:
        """After a checkpoint load overwrote `checkpoint_views()` in place: set the step
        count and publish the new masters to the segments (and replicas)."""
        self.optimizer.drain()
        adam, stepped = self.cpu_adam, set(self._stepped_groups())
        if self.reducer is not None:  # the loaded full tensors: take this process's shard
            self._scatter_gathered()
        adam.load_state_dict({"groups": [
            {"master": adam.master(g), "exp_avg": adam.exp_avg(g),
             "exp_avg_sq": adam.exp_avg_sq(g), "step": optimizer_step if g in stepped else 0}
            for g in range(adam.num_groups)]})
        self.last_iteration = iteration
        if self.reducer is None:
            for owner in self.owners.values():
                owner.segment.write(owner.master(adam), version=iteration)
        else:
            for owner in self.owners.values():
                if owner.writes_segment:
                    lo, hi = owner.shard
                    owner.segment.params[lo:hi].copy_(owner.master(adam))
            self._publish_shards(iteration)
        self.distributor.distribute(iteration)

    # --- data parallelism --------------------------------------------------------------

    def _verdict_group(self) -> dist.ProcessGroup | None:
        """Where the overflow flags and squared norms are summed: the whole world when
        the replicas split the gradient (each element counted once), one replica's
        pipeline when every replica holds all of it (ZeRO-0)."""
        if self.reducer is not None and self.config.zero_stage == 0:
            return self.groups.pipeline
        return self.host_group

    def _publish_shards(self, iteration: int) -> None:
        """The replicas of a pipeline rank wrote their shards of its stages into the
        node's segments: once all are in, the first one publishes the version."""
        dist.barrier(group=self.groups.data_parallel)
        if self.layout.data_parallel_rank == 0:
            for owner in self.owners.values():
                owner.segment.publish(iteration)

    def _gathered_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """checkpoint_views() with data parallelism: every replica gathers the full
        master, exp_avg and exp_avg_sq of its stages from the shards (the checkpoint
        writer keeps one copy of tensors several ranks hold)."""
        d = self.layout.data_parallel_size
        self._gathered, out = {}, {}
        for b, owner in self.owners.items():
            full = []
            for part in owner.state(self.cpu_adam):
                if self.config.zero_stage == 0:
                    full.append(part.clone())
                    continue
                size = -(-owner.numel // d)
                send = torch.zeros(size)
                send[:part.numel()] = part
                recv = torch.empty(size * d)
                dist.all_gather_into_tensor(recv, send, group=self.groups.data_parallel)
                full.append(recv[:owner.numel])
            self._gathered[b] = tuple(full)
            module = self.modules[b]
            for s, name in zip(module.layout.slices, module.model_names()):
                out[name] = tuple(t[s.offset:s.offset + s.numel].view(s.shape) for t in full)
        return out

    def _scatter_gathered(self) -> None:
        """After a load filled the gathered tensors: copy this process's shard back."""
        adam = self.cpu_adam
        for b, owner in self.owners.items():
            full = self._gathered[b]
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    for get, tensor in zip((adam.master, adam.exp_avg, adam.exp_avg_sq), full):
                        get(group).copy_(tensor[lo:hi])
        self._gathered = {}

    def _host_memory(self) -> dict:
        """Host memory this process holds for the optimizer (fp32 master, m, v) and
        the shared memory of the segments per node (max over processes and nodes).
        Collective."""
        adam = self.cpu_adam
        state = sum(get(g).nbytes for g in range(adam.num_groups)
                    for get in (adam.master, adam.exp_avg, adam.exp_avg_sq))
        nodes = -(-self.layout.world_size // self.store.procs_per_node)
        table = torch.zeros(nodes + 1, dtype=torch.float64)
        table[self.store.node] = sum(seg.params.nbytes for seg in self.store.created())
        table[nodes] = state
        maxima = table.clone()
        dist.all_reduce(table, group=self.host_group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.host_group)
        return {"host_optimizer_state_bytes": int(maxima[nodes]),
                "host_gradient_pool_bytes": self.host_pool.capacity_bytes,
                "shared_memory_bytes_per_node": int(table[:nodes].max())}

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
        self.optimizer.close()  # the last corrections publish their stages
        self.distributor.close()
        self.store.close()
        self.device.close()

