"""One run's plan, built once: what --plan prints and what the trainer runs.

A `RunPlan` is the run's schedule and its validation, the memory it needs per GPU and per
node, what that memory is held against (a hardware profile's capacity for --plan, what the
machine has free at the start for the run), the optimizer's placement resolved
(--optimizer-gpu-stride auto takes its split here, in the device memory the run leaves),
and, priced on a hardware profile, the predicted iteration and its parts.

--plan builds it on a profile's nodes (`plan_on_profile`). The trainer builds one per rank
in two steps around its fit check (`starting_plan`: the memory of what is fixed before
the start; then `resolved_plan`, with the device bytes the check found beyond it) and runs
exactly it: megatron/pipeline/config.py projects it into the runtime's settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron.config.placement import ON_HOST, Placement, split_flag
from megatron.config.run import RunConfig
from megatron.schedules.hardware import HardwareProfile, update_rates
from megatron.schedules.instructions import Schedule
from megatron.schedules.memory_model import MemoryPlan, Shortfall
from megatron.schedules.optimizer_stride import SplitChoice, UpdateRates
from megatron.schedules.simulator import SimResult
from megatron.schedules.validator import ValidationReport

from .evaluate import (
    Configuration,
    Evaluation,
    Where,
    base_configuration,
    planned,
    profile_headroom,
    ranks_of,
    resolved_split,
    simulated,
    where_of,
)
from .fit import FreeMemory
from .shape import run_schedule

# The parts of an iteration the runtime measures (the metrics' fields of these names, means
# over the ranks) and the plan predicts: compute, the bubbles, and the optimizer's work the
# main thread waits for (iteration = the three).
PARTS = ("gpu_time_s", "bubble_time_s", "exposed_optimizer_time_s")


@dataclass(frozen=True)
class Capacity:
    """What a plan's memory is held against, in bytes: one GPU's (None: not bounded, the
    CPU device layer without a capacity), the host's and /dev/shm's per node, the node's
    NVMe drives'."""

    gpu: int | None
    host: int
    shm: int
    nvme: int = 0

    @classmethod
    def of_profile(cls, hardware: HardwareProfile) -> Capacity:
        gpu = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes
        return cls(gpu if hardware.gpu_memory_bytes else None, hardware.host_memory_bytes,
                   hardware.shm_bytes, hardware.nvme_capacity_bytes)

    @classmethod
    def of_free(cls, free: FreeMemory) -> Capacity:
        return cls(free.device, free.host, free.shm)


@dataclass(frozen=True)
class PredictedIteration:
    """A plan's simulated iteration on a hardware profile, with its parts (PARTS)."""

    hardware: str  # the profile's name
    iteration_s: float
    gpu_time_s: float  # compute, the mean over the ranks
    bubble_time_s: float  # the rest of the iteration on a rank, the mean
    exposed_optimizer_time_s: float  # optimizer work after the last compute
    bubble_ratio: float
    mfu: float
    state_io_busy_s: float = 0.0  # optimizer states on NVMe: the busiest drive
    exposed_state_io_s: float = 0.0  # and its reads and writes after the last compute

    @classmethod
    def of(cls, simulation: SimResult, mfu: float, hardware: str) -> PredictedIteration:
        gpu = sum(simulation.busy) / len(simulation.busy)
        exposed = simulation.exposed_optimizer_time
        return cls(hardware, simulation.iteration_time, gpu,
                   max(0.0, simulation.iteration_time - gpu - exposed), exposed,
                   simulation.mean_bubble_ratio, mfu, simulation.state_io_busy_time,
                   simulation.exposed_state_io_time)

    def parts(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARTS}

    def fields(self) -> dict[str, float]:
        """The metrics' fields: beside each measured figure, `predicted_` and its name."""
        return {"predicted_iteration_time_s": self.iteration_s,
                **{f"predicted_{name}": value for name, value in self.parts().items()}}


@dataclass(frozen=True)
class RunPlan:
    """One run's plan (see the module docstring). `rank`: the pipeline rank it was built
    for (the run builds one per rank: auto's split is each rank's own); None for --plan."""

    config: Configuration  # the shape and the optimizer's share, resolved
    schedule: Schedule
    report: ValidationReport  # the schedule's validation, done once
    memory: MemoryPlan
    placement: Placement  # where the updates run (never a split still to choose)
    where: Where
    capacity: Capacity
    optimizer_bytes_per_param: int
    hardware: HardwareProfile | None  # what prices the prediction (None: nothing does)
    missing: tuple[Shortfall, ...] = ()  # against the profile's capacity (--plan)
    simulation: SimResult | None = None
    mfu: float | None = None
    split_choice: SplitChoice | None = None  # what auto weighed
    split_note: str = ""  # what auto took, in words ('' without auto)
    rank: int | None = None
    device_headroom_bytes: int | None = None  # the rank's device bytes beyond the start

    @property
    def fits(self) -> bool:
        return not self.missing

    @property
    def prediction(self) -> PredictedIteration | None:
        if self.simulation is None or self.hardware is None:
            return None
        return PredictedIteration.of(self.simulation, self.mfu, self.hardware.name)

    def evaluation(self) -> Evaluation:
        """This plan as the planner's candidate (the nearest fit starts from it)."""
        return Evaluation(self.config, self.schedule, self.memory, list(self.missing),
                          self.report, self.simulation, self.mfu,
                          self.optimizer_bytes_per_param, self.where,
                          self.placement.subgroup_size, self.split_choice)

    def summary(self) -> dict:
        """--plan --json's `configuration`: the shape, the flags, the predictions."""
        out = self.evaluation().summary()
        prediction = self.prediction
        if prediction is not None:
            out["predicted_parts"] = prediction.parts()
        return out


def plan_on_profile(run: RunConfig, hardware: HardwareProfile) -> RunPlan:
    """--plan: the run's own configuration on `hardware`'s nodes (--nodes, --gpus-per-node),
    held against the profile's capacity and priced on it."""
    config = base_configuration(run)
    schedule, report = run_schedule(run, ranks_of(run, config, hardware),
                                    run.model.planned_vocab_size)
    start = starting_plan(run, config, schedule, report, hardware, where_of(run, hardware))
    return resolved_plan(run, start, profile_headroom(start, hardware),
                         lambda _: update_rates(hardware), hardware,
                         Capacity.of_profile(hardware))


def run_configuration(run: RunConfig, ranks: int, procs_per_node: int) -> Configuration:
    """The run's own configuration on `ranks` pipeline ranks, `procs_per_node` a node."""
    return replace(base_configuration(run), nodes=math.ceil(ranks / procs_per_node))


def run_start(run: RunConfig, ranks: int, procs_per_node: int, on_cuda: bool,
              hardware: HardwareProfile | None = None) -> Evaluation:
    """The start of a training run's plan (starting_plan) on `ranks` pipeline ranks,
    `procs_per_node` of them a node: its schedule (built, or read from --schedule-file, and
    validated once) and its memory, to be held against what the machine has free."""
    schedule, report = run_schedule(run, ranks, run.model.planned_vocab_size)
    return starting_plan(run, run_configuration(run, ranks, procs_per_node), schedule, report,
                         hardware, Where(procs_per_node, on_cuda, against_profile=False))


def starting_plan(run: RunConfig, config: Configuration, schedule: Schedule,
                  report: ValidationReport, hardware: HardwareProfile | None,
                  where: Where) -> Evaluation:
    """The memory of what is fixed before the run starts: a split chosen at start-up
    (auto) has no device memory of its own (its subgroups take what the run leaves:
    resolved_plan), so it starts with every update on the CPU."""
    fixed = config if config.updates.split is not None else replace(config, updates=ON_HOST)
    return planned(run, fixed, schedule, report, hardware, where=where)


def resolved_plan(run: RunConfig, start: Evaluation, headroom: dict[int, int | None],
                  rates_for: Callable[[int], UpdateRates | None],
                  hardware: HardwareProfile | None, capacity: Capacity,
                  rank: int | None = None) -> RunPlan:
    """The plan from its start (`starting_plan`): auto's split resolved on the ranks of
    `headroom` (their device bytes beyond the start, None: unbounded) over
    `rates_for(subgroup size)`, then priced on `hardware` (None: not predicted)."""
    if run.cpu_optimizer.placement.updates.split is None:
        final = resolved_split(run, start, headroom, rates_for, hardware)
    else:
        final = simulated(run, start, hardware) if hardware is not None else start
    return RunPlan(
        final.config, final.schedule, final.report, final.memory, final.placement(run),
        final.where, capacity, final.optimizer_bytes_per_param, hardware,
        tuple(final.missing), final.simulation, final.mfu, final.split_choice,
        split_text(run, final), rank, headroom.get(rank) if rank is not None else None)


def split_text(run: RunConfig, final: Evaluation) -> str:
    """What --optimizer-gpu-stride auto took and why, in words ('' without auto)."""
    if run.cpu_optimizer.placement.updates.split is not None:
        return ""
    split, choice = final.config.updates.split, final.split_choice
    what = (f"stride k = {split}" if split >= 0
            else f"split {split_flag(split)} (GPU-heavy)")
    if choice is None:
        return (f"optimizer GPU {what} (auto): no update rates to weigh, or the device "
                "memory beyond the run's needs holds no useful subgroup")
    predicted = ", ".join(f"{split_flag(s)} {t:.3g} s" for s, t in choice.predicted_s.items())
    taken = "" if split == choice.split else (
        f"; {split_flag(choice.split)} simulated no faster, or not fitting")
    return (f"optimizer GPU {what} (auto; Eq. 1: {choice.model.k_real:.3g}; predicted for "
            f"{choice.numel} parameters in subgroups of {choice.subgroup}: {predicted}"
            f"{taken})")
