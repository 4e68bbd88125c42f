"""One candidate configuration, priced: its memory per GPU and per node against a hardware
profile, and (when asked) its simulated iteration.

A candidate (`Configuration`) is the part of a run the planner varies: schedule, forward
stages, backward split d, micro-batch size, node count, the device's share of the optimizer
updates and where and in what precision the optimizer state lives. Everything else (the
model, the global batch, the working precision) is the run configuration's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron.config.errors import ConfigError
from megatron.config.placement import (
    ON_HOST,
    DeviceShare,
    Interleaved,
    Placement,
    StateStorage,
)
from megatron.config.run import DTYPE_BYTES, RunConfig, optimizer_state_bytes
from megatron.schedules.cost_model import (
    backward_stage_params,
    derived_costs,
    megatron_model_flops_per_token,
)
from megatron.schedules.hardware import HardwareProfile, get_hardware, update_rates
from megatron.schedules.instructions import BackwardStage, Op, Schedule
from megatron.schedules.memory_model import MemoryPlan, Shortfall, shortfalls
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.optimizer_stride import SplitChoice, UpdateRates, auto_split
from megatron.schedules.placement_cost import device_update_costs
from megatron.schedules.simulator import SimResult, simulate
from megatron.schedules.subgroup_memory import (
    MIN_SUBGROUP,
    default_subgroup_size,
    planned_subgroup_size,
)
from megatron.schedules.validator import ValidationReport, validate

from .fit import PlannedShape, memory_plan
from .shape import Unbuildable, build_run_schedule, schedule_name

DEFAULT_HARDWARE = "paper-v100"


@dataclass(frozen=True)
class Configuration:
    schedule: str
    forward_stages: int | None  # None: the default for the schedule
    backward_split: int | None
    micro_batch_size: int
    nodes: int
    # the device's share of the optimizer updates (megatron/config/placement.py)
    updates: DeviceShare = ON_HOST
    # the host optimizer state's precision: Adam's m and v, the master (None: the run's)
    optimizer_state_dtype: str | None = None
    master_dtype: str | None = None
    states: StateStorage | None = None  # where master, m and v live (None: the run's)
    # the main gradients in bf16 (Megatron-LM's --grad-reduce-in-bf16; None: the run's)
    grad_reduce_in_bf16: bool | None = None

    def flags(self) -> str:
        parts = [f"--pipeline-schedule {self.schedule}"]
        if self.forward_stages is not None:
            parts.append(f"--forward-stages {self.forward_stages}")
        if self.backward_split is not None:
            parts.append(f"--backward-split {self.backward_split}")
        parts += [f"--micro-batch-size {self.micro_batch_size}", f"--nodes {self.nodes}"]
        if self.updates.planned_flags():
            parts.append(self.updates.planned_flags())
        return " ".join(parts + self.precision_flags())

    def precision_flags(self) -> list[str]:
        """The flags of the optimizer state's precision and place it sets ([] for the
        run's)."""
        flags = [f"--{flag} {dtype}" for flag, dtype in (
            ("optimizer-state-dtype", self.optimizer_state_dtype),
            ("master-dtype", self.master_dtype)) if dtype is not None]
        if self.states is not None and self.states.on_nvme:
            flags.append("--optimizer-state-location nvme --optimizer-nvme-path DIR")
        if self.grad_reduce_in_bf16:
            flags.append("--grad-reduce-in-bf16")
        return flags

    def placement(self, run: RunConfig) -> Placement:
        """Where this candidate's optimizer updates run and its states live."""
        own = run.cpu_optimizer.placement
        return replace(own, updates=self.updates, states=self.states or own.states)


def plain_updates(updates: DeviceShare) -> DeviceShare:
    """`updates` without device subgroups where the lowering would mark them (the plan
    every split of a shape is compared against)."""
    return ON_HOST if updates.marks_exposed_stages else updates


def optimizer_precision(run: RunConfig, config: Configuration) -> tuple[str, str]:
    """(m and v, master): the dtypes of `config`'s host optimizer state."""
    p = run.precision
    return (config.optimizer_state_dtype or p.optimizer_state_dtype,
            config.master_dtype or p.master_dtype)


def gradient_precision(run: RunConfig, config: Configuration) -> RunConfig:
    """`run` with `config`'s main-gradient precision (what the gradient buffers, the
    offload and the host gradients are priced at)."""
    if config.grad_reduce_in_bf16 is None:
        return run
    return run.evolve(precision={"grad_reduce_in_bf16": config.grad_reduce_in_bf16})


def optimizer_bytes(run: RunConfig, config: Configuration) -> int:
    """Host bytes per parameter of `config`'s master and Adam moments (12, 10, 8 or 6)."""
    moments, master = optimizer_precision(run, config)
    return optimizer_state_bytes(DTYPE_BYTES[master], DTYPE_BYTES[moments])


@dataclass(frozen=True)
class Where:
    """Where a plan is for: its pipeline ranks per node, whether they run on CUDA, and
    what its memory is held against: the hardware profile's capacity (--plan, the search),
    or what the machine has free when the run starts (the trainer's fit check, fit.py)."""

    procs_per_node: int
    on_cuda: bool
    against_profile: bool = True


def where_of(run: RunConfig, hardware: HardwareProfile) -> Where:
    """A plan on `hardware`'s nodes, held against its capacity."""
    return Where(gpus_per_node(run, hardware), hardware.device_kind == "cuda")


@dataclass
class Evaluation:
    config: Configuration
    schedule: Schedule
    memory: MemoryPlan
    missing: list[Shortfall]
    report: ValidationReport | None = None  # the schedule's validation, done once
    simulation: SimResult | None = None
    mfu: float | None = None  # model FLOPs utilization of the simulated iteration
    optimizer_bytes_per_param: int = 0  # host bytes of the master and moments per parameter
    where: Where | None = None  # None: the hardware profile's nodes (where_of)
    # the device subgroups' size where the plan sets it (auto's, within the memory left);
    # None: the flag's, or the runtime's default
    subgroup_size: int | None = None
    split_choice: SplitChoice | None = None  # what --optimizer-gpu-stride auto weighed

    @property
    def fits(self) -> bool:
        return not self.missing

    def placement(self, run: RunConfig) -> Placement:
        """Where the optimizer's updates run and its states live, as planned."""
        placement = self.config.placement(run)
        if self.subgroup_size is not None:
            placement = replace(placement, subgroup_size=self.subgroup_size)
        return placement

    def summary(self) -> dict:
        s = self.schedule
        out = {"schedule": s.name, "forward_stages": s.forward_stages,
               "backward_split": s.backward_split,
               "micro_batch_size": self.config.micro_batch_size,
               "micro_batches": s.micro_batches, "nodes": self.config.nodes,
               "optimizer_gpu_stride": self.config.updates.split,
               "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
               "fits": self.fits, "flags": self.config.flags()}
        if self.simulation is not None:
            out.update(predicted_iteration_s=self.simulation.iteration_time,
                       bubble_ratio=self.simulation.mean_bubble_ratio,
                       exposed_optimizer_s=self.simulation.exposed_optimizer_time,
                       mfu=self.mfu)
            if self.memory.disk_per_node:
                out.update(nvme_bytes_per_node=max(self.memory.disk_per_node),
                           nvme_busy_s=self.simulation.state_io_busy_time,
                           exposed_nvme_s=self.simulation.exposed_state_io_time)
        return out


def plan_hardware(run: RunConfig) -> HardwareProfile:
    name = run.planning.hardware or DEFAULT_HARDWARE
    try:
        return get_hardware(name)
    except KeyError as exc:
        raise ConfigError("--hardware", name, exc.args[0]) from None


def run_hardware(run: RunConfig) -> HardwareProfile | None:
    """The profile a training run's plan is priced on: --hardware's, none without it (the
    default profile describes another machine than the one the run is on)."""
    return plan_hardware(run) if run.planning.hardware is not None else None


def gpus_per_node(run: RunConfig, hardware: HardwareProfile) -> int:
    return run.planning.gpus_per_node or hardware.gpus_per_node


def ranks_of(run: RunConfig, config: Configuration, hardware: HardwareProfile) -> int:
    return config.nodes * gpus_per_node(run, hardware)


def base_configuration(run: RunConfig) -> Configuration:
    """The candidate the run's own flags describe."""
    p = run.parallel
    return Configuration(schedule_name(run), p.forward_stages, p.backward_split,
                         run.training.micro_batch_size, run.planning.nodes or 1,
                         run.cpu_optimizer.placement.updates)


def configured(run: RunConfig, config: Configuration, keep_partition: bool = True
               ) -> RunConfig:
    """`run` with `config`'s shape and optimizer precision; a hand partition
    (--stage-layers) is kept, when `keep_partition`, for the run's own shape only."""
    own = keep_partition and shape_of(config) == shape_of(base_configuration(run))
    moments, master = optimizer_precision(run, config)
    return run.evolve(
        parallel={"pipeline_schedule": config.schedule, "forward_stages": config.forward_stages,
                  "backward_split": config.backward_split,
                  "stage_layers": run.parallel.stage_layers if own else None},
        training={"micro_batch_size": config.micro_batch_size},
        cpu_optimizer=config.placement(run).flags(),
        precision={"optimizer_state_dtype": moments, "master_dtype": master,
                   "grad_reduce_in_bf16": gradient_precision(run, config).precision
                   .grad_reduce_in_bf16},
        planning={"nodes": config.nodes})


def shape_of(config: Configuration) -> Configuration:
    """`config` without what leaves its schedule unchanged (the device subgroups, the
    precisions; the place of the states is kept: NVMe adds its reads and writes to the
    programs)."""
    return replace(config, updates=plain_updates(config.updates), optimizer_state_dtype=None,
                   master_dtype=None, grad_reduce_in_bf16=None)


def evaluate(run: RunConfig, config: Configuration, hardware: HardwareProfile,
             simulate_it: bool = True) -> Evaluation:
    """Memory (and, when asked, the simulated iteration) of `config` under `run`'s model.
    Raises ConfigError when the configuration cannot be built (shapes that do not divide)."""
    evaluation = evaluation_or_reason(run, config, hardware)
    if isinstance(evaluation, Unbuildable):
        raise evaluation.error()
    return simulated(run, evaluation, hardware) if simulate_it else evaluation


def evaluation_or_reason(run: RunConfig, config: Configuration, hardware: HardwareProfile
                         ) -> Evaluation | Unbuildable:
    """evaluate() without the simulation, or why `config` cannot be built."""
    base = replace(config, updates=plain_updates(config.updates))
    shaped = configured(run, shape_of(config))
    schedule = build_run_schedule(shaped, ranks_of(run, config, hardware),
                                  run.model.planned_vocab_size)
    if isinstance(schedule, Unbuildable):
        return schedule
    evaluation = planned(run, base, schedule, validate(schedule), hardware)
    if config.updates.marks_exposed_stages:
        evaluation = with_subgroups(run, evaluation, config.updates, hardware)
    return evaluation


def with_subgroups(run: RunConfig, plain: Evaluation, updates: DeviceShare,
                   hardware: HardwareProfile) -> Evaluation:
    """`plain` (all updates on the CPU) with device subgroups placed by `updates` where an
    update would be exposed; only optimizer starts change, so its validation holds."""
    placed = place_device_subgroups(plain.schedule, report=plain.report)
    return planned(run, replace(plain.config, updates=updates), placed, plain.report,
                   hardware, where=plain.where)


def planned(run: RunConfig, config: Configuration, schedule: Schedule,
            report: ValidationReport, hardware: HardwareProfile | None,
            subgroup_size: int | None = None, where: Where | None = None) -> Evaluation:
    """`config`'s memory plan (its schedule given) and what it lacks on `hardware`
    (`subgroup_size`: the device subgroups', default the flag's; `where`: the nodes it is
    for, default the profile's, whose capacity it is then held against)."""
    where = where or where_of(run, hardware)
    evaluation = Evaluation(config, schedule, None, [], report,
                            optimizer_bytes_per_param=optimizer_bytes(run, config),
                            where=where, subgroup_size=subgroup_size)
    evaluation.memory = memory_plan(gradient_precision(run, config), schedule, PlannedShape(
        run.model, config.micro_batch_size, procs_per_node=where.procs_per_node,
        on_cuda=where.on_cuda, placement=evaluation.placement(run),
        optimizer_bytes=evaluation.optimizer_bytes_per_param, hardware=hardware), report)
    if where.against_profile:
        evaluation.missing = shortfalls(evaluation.memory, hardware)
    return evaluation


def simulated(run: RunConfig, evaluation: Evaluation, hardware: HardwareProfile
              ) -> Evaluation:
    """`evaluation` with its simulated iteration (the schedule is reused); device subgroups
    are priced from the profile's rates when it has them (else like a CPU update). A split
    chosen at start-up (auto) is resolved first, from the profile's rates and the device
    memory the profile's GPU leaves (resolved_split)."""
    if evaluation.simulation is None:
        config, schedule = evaluation.config, evaluation.schedule
        if config.updates.split is None:
            plain = planned(run, replace(config, updates=ON_HOST), schedule,
                            evaluation.report, hardware, where=evaluation.where)
            return resolved_split(run, plain, profile_headroom(plain, hardware),
                                  lambda _: update_rates(hardware), hardware)
        costs = derived_costs(schedule, run.model, hardware, config.micro_batch_size,
                              run.model.seq_length, optimizer_bytes(run, config),
                              gradient_precision(run, config).precision.host_gradient_bytes)
        rates = update_rates(hardware)
        if config.updates.uses_device and rates is not None:
            params = backward_stage_params(run.model, schedule.partition,
                                           schedule.backward_split)
            costs = replace(costs, device_update=device_update_costs(config.updates, params,
                                                                     rates))
        evaluation.simulation = simulate(schedule, costs, evaluation.report)
        evaluation.mfu = model_flops_utilization(run, evaluation, hardware)
    return evaluation


def profile_headroom(plan: Evaluation, hardware: HardwareProfile) -> dict[int, int | None]:
    """The device bytes each rank's GPU has beyond `plan` on `hardware` (None where the
    profile does not know the GPU's memory)."""
    gpu_free = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes
    return {rank: gpu_free - plan.memory.gpu_total(rank) if hardware.gpu_memory_bytes else None
            for rank in range(plan.schedule.ranks)}


def resolved_split(run: RunConfig, plain: Evaluation, headroom: dict[int, int | None],
                   rates_for: Callable[[int], UpdateRates | None],
                   hardware: HardwareProfile | None) -> Evaluation:
    """--optimizer-gpu-stride auto resolved on the ranks of `headroom`: `plain` (its
    updates on the CPU, the subgroups' marks in its schedule) with the split it takes, or
    itself (stride 0). The subgroups get the device bytes each rank has beyond `plain`
    (`headroom`, None: unbounded), no more than its gradient buffers hold (the runtime's
    cap), in subgroups of the flag's size (or the default) shrunk to that; where that
    leaves them too small, stride 0. Eq. 1's candidates are priced at that layout over
    `rates_for(size)` (auto_split: the profile's rates for --plan, the rates calibrated on
    this machine for the run), and with a profile to simulate on (`hardware`), the split
    is taken only where it fits as stride 0 does and its iteration is shorter: auto never
    loses."""
    s = plain.schedule
    params = backward_stage_params(run.model, s.partition, s.backward_split)
    largest = {rank: max(params[b] for b in stages)
               for rank in headroom if (stages := subgroup_stages(s, rank))}
    resolved = replace(plain, split_choice=None)
    if hardware is not None:
        resolved = simulated(run, resolved, hardware)
    if not largest:
        return resolved
    requested = run.cpu_optimizer.optimizer_subgroup_size
    sizes = []
    for rank, numel in largest.items():
        budget = gradient_buffer_bytes(plain, rank)
        if headroom[rank] is not None:
            budget = min(budget, max(0, headroom[rank]))
        size = planned_subgroup_size(requested, numel, budget)
        wanted = min(requested or default_subgroup_size(numel), numel)
        if size < min(wanted, MIN_SUBGROUP):  # the memory left holds no useful subgroup
            return resolved
        sizes.append(size)
    rates = rates_for(min(sizes))
    if rates is None:
        return resolved
    choice = auto_split(rates, max(largest.values()), min(sizes))
    resolved.split_choice, resolved.subgroup_size = choice, min(sizes)
    if choice.split == 0:
        return resolved
    candidate = planned(run, replace(plain.config, updates=Interleaved(choice.split)), s,
                        plain.report, hardware, min(sizes), plain.where)
    candidate.split_choice = choice
    if hardware is None:
        return candidate
    candidate = simulated(run, candidate, hardware)
    if candidate.fits >= resolved.fits and (candidate.simulation.iteration_time
                                            < resolved.simulation.iteration_time):
        return candidate
    return resolved


def gradient_buffer_bytes(plan: Evaluation, rank: int) -> int:
    """What `rank`'s gradient buffers hold (the budget the runtime gives its subgroups)."""
    return plan.memory.per_gpu[rank]["gradient_buffers"]


def subgroup_stages(schedule: Schedule, rank: int) -> list[BackwardStage]:
    """The stages `rank`'s program updates in subgroups (OPTIMIZER_START_SUBGROUPS)."""
    return [BackwardStage(i.stage, i.sub) for i in schedule.programs[rank]
            if i.op == Op.OPTIMIZER_START_SUBGROUPS]


def model_flops_utilization(run: RunConfig, evaluation: Evaluation,
                            hardware: HardwareProfile) -> float:
    """The model FLOPs of the simulated pipeline's tokens (forward and backward, no
    recomputation, as --log-throughput counts them) over its GPUs' peak for its iteration:
    the datasheet peak where the profile has it (HardwareProfile.mfu_peak_flops)."""
    s, config = evaluation.schedule, evaluation.config
    tokens = s.micro_batches * config.micro_batch_size * run.model.seq_length
    peak = s.ranks * hardware.mfu_peak_flops
    return megatron_model_flops_per_token(run.model) * tokens / (
        evaluation.simulation.iteration_time * peak)
