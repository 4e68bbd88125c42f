"""One candidate configuration, priced: its memory per GPU and per node against a hardware
profile, and (when asked) its simulated iteration.

A candidate (`Configuration`) is the part of a run the planner varies: schedule, forward
stages, backward split d, micro-batch size, node count, the device's share of the optimizer
updates and where and in what precision the optimizer state lives. Everything else (the
model, the global batch, the working precision) is the run configuration's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.config.errors import ConfigError
from megatron.config.placement import (
    ON_HOST,
    AutoSplit,
    DeviceShare,
    Interleaved,
    Placement,
    StateStorage,
)
from megatron.config.run import DTYPE_BYTES, RunConfig, optimizer_state_bytes
from megatron.schedules.cost_model import (
    backward_stage_params,
    derived_costs,
    model_flops_per_token,
)
from megatron.schedules.hardware import HardwareProfile, get_hardware, update_rates
from megatron.schedules.instructions import BackwardStage, Op, Schedule
from megatron.schedules.memory_model import MemoryPlan, Shortfall, shortfalls
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.optimizer_stride import auto_split
from megatron.schedules.placement_cost import device_update_costs
from megatron.schedules.simulator import SimResult, simulate
from megatron.schedules.subgroup_memory import (
    MIN_SUBGROUP,
    planned_subgroup_size,
    subgroup_slots_bytes,
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


def optimizer_bytes(run: RunConfig, config: Configuration) -> int:
    """Host bytes per parameter of `config`'s master and Adam moments (12, 10, 8 or 6)."""
    moments, master = optimizer_precision(run, config)
    return optimizer_state_bytes(DTYPE_BYTES[master], DTYPE_BYTES[moments])


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

    @property
    def fits(self) -> bool:
        return not self.missing

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
        precision={"optimizer_state_dtype": moments, "master_dtype": master},
        planning={"nodes": config.nodes})


def shape_of(config: Configuration) -> Configuration:
    """`config` without what leaves its schedule unchanged (the device subgroups, the
    precision; the place of the states is kept: NVMe adds its reads and writes to the
    programs)."""
    return replace(config, updates=plain_updates(config.updates), optimizer_state_dtype=None,
                   master_dtype=None)


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
                   hardware)


def planned(run: RunConfig, config: Configuration, schedule: Schedule,
            report: ValidationReport, hardware: HardwareProfile,
            subgroup_size: int | None = None) -> Evaluation:
    """`config`'s memory plan (its schedule given) and what it lacks on `hardware`
    (`subgroup_size`: the device subgroups', default the flag's)."""
    placement = config.placement(run)
    if subgroup_size is not None:
        placement = replace(placement, subgroup_size=subgroup_size)
    memory = memory_plan(run, schedule, PlannedShape(
        run.model, config.micro_batch_size, procs_per_node=gpus_per_node(run, hardware),
        on_cuda=hardware.device_kind == "cuda", placement=placement,
        optimizer_bytes=optimizer_bytes(run, config), hardware=hardware), report)
    return Evaluation(config, schedule, memory, shortfalls(memory, hardware), report,
                      optimizer_bytes_per_param=optimizer_bytes(run, config))


def simulated(run: RunConfig, evaluation: Evaluation, hardware: HardwareProfile
              ) -> Evaluation:
    """`evaluation` with its simulated iteration (the schedule is reused); device subgroups
    are priced from the profile's rates when it has them (else like a CPU update)."""
    if evaluation.simulation is None:
        config, schedule = evaluation.config, evaluation.schedule
        if isinstance(config.updates, AutoSplit):
            return resolved_auto(run, evaluation, hardware)
        costs = derived_costs(schedule, run.model, hardware, config.micro_batch_size,
                              run.model.seq_length, optimizer_bytes(run, config))
        rates = update_rates(hardware)
        if config.updates.uses_device and rates is not None:
            params = backward_stage_params(run.model, schedule.partition,
                                           schedule.backward_split)
            costs = replace(costs, device_update=device_update_costs(config.updates, params,
                                                                     rates))
        evaluation.simulation = simulate(schedule, costs, evaluation.report)
        evaluation.mfu = model_flops_utilization(run, evaluation, hardware)
    return evaluation


def resolved_auto(run: RunConfig, auto: Evaluation, hardware: HardwareProfile) -> Evaluation:
    """--optimizer-gpu-stride auto as the plan prices it: the evaluation of the split it
    resolves to. The subgroups get the device memory that stride 0's plan leaves free on
    each GPU (their slots live beside the gradient buffers; the runtime caps them at what
    those hold); Eq. 1's candidates are priced at the subgroup size that memory allows
    (auto_split), and the split found is simulated against stride 0: it is taken only
    where it fits as stride 0 does and its iteration is shorter, so auto never loses."""
    plain = simulated(run, planned(run, replace(auto.config, updates=ON_HOST),
                                   auto.schedule, auto.report, hardware), hardware)
    rates = update_rates(hardware)
    s = auto.schedule
    params = backward_stage_params(run.model, s.partition, s.backward_split)
    largest = {rank: max(params[BackwardStage(i.stage, i.sub)] for i in program
                         if i.op == Op.OPTIMIZER_START_SUBGROUPS)
               for rank, program in enumerate(s.programs)
               if any(i.op == Op.OPTIMIZER_START_SUBGROUPS for i in program)}
    if rates is None or not largest:
        return plain
    gpu_free = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes
    sizes = []
    for rank, numel in largest.items():
        size = planned_subgroup_size(run.cpu_optimizer.optimizer_subgroup_size, numel,
                                     auto.memory.per_gpu[rank]["gradient_buffers"])
        if hardware.gpu_memory_bytes:  # 0: a profile that does not know the GPU's memory
            beside = gpu_free - plain.memory.gpu_total(rank)
            size = min(size, max(0, beside) // subgroup_slots_bytes(
                1, run.precision.working_bytes))
        sizes.append(size)
    if min(sizes) < min(MIN_SUBGROUP, min(largest.values())):
        return plain
    split = auto_split(rates, max(largest.values()), min(sizes)).split
    if split == 0:
        return plain
    candidate = simulated(run, planned(run, replace(auto.config, updates=Interleaved(split)),
                                       s, auto.report, hardware, min(sizes)), hardware)
    if candidate.fits >= plain.fits and (candidate.simulation.iteration_time
                                         < plain.simulation.iteration_time):
        return candidate
    return plain


def model_flops_utilization(run: RunConfig, evaluation: Evaluation,
                            hardware: HardwareProfile) -> float:
    """The model FLOPs of the simulated pipeline's tokens (forward and backward, no
    recomputation, as --log-throughput counts them) over its GPUs' peak for its iteration:
    the datasheet peak where the profile has it (HardwareProfile.mfu_peak_flops)."""
    s, config = evaluation.schedule, evaluation.config
    tokens = s.micro_batches * config.micro_batch_size * run.model.seq_length
    peak = ranks_of(run, config, hardware) * hardware.mfu_peak_flops
    return model_flops_per_token(run.model) * tokens / (
        evaluation.simulation.iteration_time * peak)
