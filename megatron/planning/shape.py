"""The schedule a run configuration asks for, on a given number of pipeline ranks.

Resolves the defaults (forward stages, backward split, the flop-balanced partition),
generates the schedule or reads it from `--schedule-file`, and checks what can be checked
before any data or model exists. For the run itself every problem is a ConfigError naming
the flag, the value and what was expected; the planner, which tries shapes that may not
exist, gets an `Unbuildable` instead and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.config.errors import ConfigError
from megatron.config.run import RunConfig
from megatron.schedules.cost_model import model_partition
from megatron.schedules.generators import (
    DEFAULT_SCHEDULE,
    RECOMPUTE_BACKWARD_RATIO,
    ScheduleTooLarge,
    build_schedule,
    schedule_kind,
)
from megatron.schedules.grid import format_programs
from megatron.schedules.instructions import Schedule
from megatron.schedules.interpreter import ScheduleError
from megatron.schedules.lowering import place_state_io
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.schedule_file import read_schedule
from megatron.schedules.validator import ValidationReport, validate


@dataclass(frozen=True)
class Unbuildable:
    """Why a run's shape cannot be built, as the error the run would end with."""

    flag: str
    value: object
    reason: str

    def error(self) -> ConfigError:
        return ConfigError(self.flag, self.value, self.reason)


def check_pipeline_shape(run: RunConfig, world_size: int) -> None:
    """What can be checked of the shape before any data or model exists (ConfigError);
    `world_size`: the pipeline ranks started."""
    p, layers = run.parallel, run.model.num_layers
    size = p.pipeline_model_parallel_size
    if size is not None and size != world_size:
        d = run.data_parallel_size
        started = world_size * d
        layout = (f"{started} processes were started, {world_size} pipeline rank(s) with "
                  f"--data-parallel-size {d}" if d > 1
                  else f"{started} process(es) were started")
        raise ConfigError("--pipeline-model-parallel-size", size,
                          f"{layout}; this layout needs {size} x {d} = {size * d}: launch "
                          f"with torchrun --nproc-per-node {size * d}")
    if p.one_process and world_size > 1:
        raise ConfigError("--pipeline-schedule", p.pipeline_schedule,
                          f"runs in one process, but {world_size} were started")
    stages = p.forward_stages
    if stages is not None and stages < world_size:
        raise ConfigError("--forward-stages", stages,
                          f"expected at least one stage per process ({world_size})")
    if stages is not None and stages > layers:
        raise ConfigError("--forward-stages", stages, f"more stages than layers ({layers})")
    if world_size > layers:
        raise ConfigError("--pipeline-model-parallel-size", world_size,
                          f"more processes than layers ({layers})")
    if p.backward_split is not None and p.backward_split < 1:
        raise ConfigError("--backward-split", p.backward_split, "expected >= 1")
    if p.stage_layers is not None:
        found = _partition(run, stages or len(p.stage_layers), vocab_size=1)
        if isinstance(found, Unbuildable):
            raise found.error()
    if p.schedule_file is not None:
        load_schedule_file(run, world_size)


def _partition(run: RunConfig, forward_stages: int, vocab_size: int,
               min_layers: int = 1) -> tuple[int, ...] | Unbuildable:
    """--stage-layers as given, or balanced by cost (embedding and head counted) with at
    least `min_layers` per stage (the backward split needs that many)."""
    layers, given = run.model.num_layers, run.parallel.stage_layers
    if given is not None:
        if len(given) != forward_stages or sum(given) != layers or min(given) < 1:
            return Unbuildable(
                "--stage-layers", ",".join(map(str, given)),
                f"expected {forward_stages} positive layer counts (one per forward stage) "
                f"summing to --num-layers ({layers})")
        return tuple(given)
    try:
        return tuple(model_partition(replace(run.model, vocab_size=vocab_size), forward_stages,
                                     run.model.seq_length, min_layers))
    except ValueError as exc:  # fewer layers than the stages (and the split) need
        return _too_few_layers(run, forward_stages, str(exc))


def _too_few_layers(run: RunConfig, forward_stages: int, reason: str) -> Unbuildable:
    """Blamed on the flag that asked for it: a backward split or a stage count that was
    given; else (both defaults) on the layers, fewer than the pipeline ranks' stages."""
    p = run.parallel
    if p.backward_split is not None and p.backward_split > 1:
        return Unbuildable("--backward-split", p.backward_split, reason)
    if p.forward_stages is not None:
        return Unbuildable("--forward-stages", p.forward_stages, reason)
    return Unbuildable("--num-layers", run.model.num_layers,
                       f"{reason} ({forward_stages} forward stages: at least one per pipeline "
                       "rank); expected fewer pipeline ranks (a plan's: --nodes x "
                       "--gpus-per-node, by default the hardware profile's) or more layers")


def schedule_name(run: RunConfig) -> str:
    """The schedule the run's programs are generated with: --pipeline-schedule's, or the
    default one where it names none (left out, or the one-process reference: planned as
    the default schedule on one rank)."""
    p = run.parallel
    return p.pipeline_schedule if p.names_pipeline_schedule else DEFAULT_SCHEDULE


def build_run_schedule(run: RunConfig, world_size: int, vocab_size: int,
                       lower: bool = True) -> Schedule | Unbuildable:
    """The schedule the configuration describes on `world_size` pipeline ranks (its
    defaults filled in), with the optimizer's device subgroups placed when
    --optimizer-gpu-stride asks for them; with `lower` False, its shape only (no programs,
    see build_schedule). Unbuildable when the shape does not exist."""
    built = _generated(run, world_size, vocab_size, lower)
    if isinstance(built, Unbuildable):
        return built
    return built[0]


def _generated(run: RunConfig, world_size: int, vocab_size: int, lower: bool
               ) -> tuple[Schedule, ValidationReport | None] | Unbuildable:
    """build_run_schedule's schedule, and its validation where placing the device
    subgroups needed one (the placement only renames optimizer starts: it holds)."""
    p = run.parallel
    name = schedule_name(run)
    kind = schedule_kind(name)
    stages = p.forward_stages
    if stages is None:
        stages = p.stage_layers and len(p.stage_layers) or (
            world_size if kind.one_stage_per_rank or run.model.num_layers < 2 * world_size
            else 2 * world_size)
    split = p.backward_split
    if split is None:
        split = 2 if kind.splits_backward and run.model.num_layers >= 2 * stages else 1
    partition = _partition(run, stages, vocab_size, min_layers=split)
    if isinstance(partition, Unbuildable):
        return partition
    try:
        schedule = build_schedule(name, world_size, stages, split, run.micro_batches,
                                  partition, backward_ratio=RECOMPUTE_BACKWARD_RATIO,
                                  lower=lower)
    except ScheduleTooLarge as exc:
        # the micro-batches come from --global-batch-size; the stages from --forward-stages
        if run.micro_batches >= stages:
            return Unbuildable("--global-batch-size", run.training.global_batch_size, str(exc))
        return Unbuildable("--forward-stages", stages, str(exc))
    except ValueError as exc:
        if "split" in str(exc):
            return Unbuildable("--backward-split", split, str(exc))
        return Unbuildable("--forward-stages", stages, str(exc))
    report = None
    placement = run.cpu_optimizer.placement
    if lower and placement.updates.marks_exposed_stages:
        report = validate(schedule)  # where updates would be exposed: simulated on it
        schedule = place_device_subgroups(schedule, report=report)
    if lower and placement.states.on_nvme:
        schedule, report = place_state_io(schedule), None  # new instructions
    return schedule, report


def generate_schedule(run: RunConfig, world_size: int, vocab_size: int,
                      lower: bool = True) -> Schedule:
    """build_run_schedule for the run itself: a shape that does not exist is bad input."""
    schedule = build_run_schedule(run, world_size, vocab_size, lower)
    if isinstance(schedule, Unbuildable):
        raise schedule.error()
    return schedule


class ScheduleFileError(ConfigError):
    """A schedule file that cannot run; `details` shows the programs around the fault."""

    def __init__(self, path: str, expected: str, details: str = "") -> None:
        super().__init__("--schedule-file", path, expected, details)


def load_schedule_file(run: RunConfig, world_size: int) -> tuple[Schedule, ValidationReport]:
    """Read, check against this run's flags, and validate --schedule-file."""
    p = run.parallel
    path = p.schedule_file
    try:
        schedule = read_schedule(path)
    except ValueError as exc:
        raise ScheduleFileError(path, str(exc)) from None
    wanted = {"ranks": world_size, "micro_batches": run.micro_batches,
              "forward_stages": p.forward_stages, "backward_split": p.backward_split,
              "partition": p.stage_layers, "name": p.pipeline_schedule}
    for key, value in wanted.items():
        found = schedule.shape()[key]
        if value is not None and found != value:
            raise ScheduleFileError(path, f"the file has {key}={found}, this run has {value}")
    on_disk = schedule.states_on_disk
    if run.cpu_optimizer.placement.states.on_nvme:
        schedule = place_state_io(schedule)  # where the file does not place them itself
    elif on_disk:
        raise ScheduleFileError(path, "no READ/WRITE_OPTIMIZER_STATES: this run keeps the "
                                      "optimizer states in host memory (give "
                                      "--optimizer-state-location nvme to keep them on disk)")
    if sum(schedule.partition) != run.model.num_layers:
        raise ScheduleFileError(path, f"the file's partition {list(schedule.partition)} has "
                                      f"{sum(schedule.partition)} layers, --num-layers is "
                                      f"{run.model.num_layers}")
    try:
        return schedule, validate(schedule)
    except ScheduleError as exc:
        raise ScheduleFileError(path, str(exc),
                                format_programs(schedule, (exc.rank, exc.index))) from None


def run_schedule(run: RunConfig, world_size: int, vocab_size: int
                 ) -> tuple[Schedule, ValidationReport]:
    """The program every rank of this run executes, and its validation, done once:
    --schedule-file's, or the generated one (valid by construction, and proven so)."""
    if run.parallel.schedule_file is not None:
        return load_schedule_file(run, world_size)
    built = _generated(run, world_size, vocab_size, lower=True)
    if isinstance(built, Unbuildable):
        raise built.error()
    schedule, report = built
    return schedule, report or validate(schedule)


def with_schedule(run: RunConfig, name: str) -> RunConfig:
    """`run` with another schedule: the coupled baselines take their default split (1)."""
    changes: dict[str, object] = {"pipeline_schedule": name}
    if not schedule_kind(name).splits_backward:
        changes["backward_split"] = None
    return run.evolve(parallel=changes)
