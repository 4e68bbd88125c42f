"""Where device subgroups go: only to the backward stages whose CPU update would be
exposed, decided from the program and a cost model, and written into the program as
OPTIMIZER_START_SUBGROUPS (validator, simulator and executor read it like any op).

A stage's update is exposed when, simulated under the cost model, its CPU optimizer task
ends after the last compute of its rank: nothing is left to hide it. Typically that is
the stage whose backward ends the iteration (the first layers) and those queued behind a
CPU lane that is slower than the compute it overlaps. The tasks that run back to back
before an exposed one on the same CPU lane (one busy period) are selected too: each of
them delays the exposed one as much as its own length.
"""

from __future__ import annotations

from dataclasses import replace

from .cost_model import CostModel, uniform_costs
from .instructions import BackwardStage, Instruction, Op, Schedule
from .simulator import simulate
from .validator import ValidationReport


def exposed_update_stages(schedule: Schedule, costs: CostModel, busy_period: bool = True,
                          report: ValidationReport | None = None) -> frozenset[BackwardStage]:
    """The backward stages whose OPTIMIZER_START task ends after their rank's last compute,
    and (busy_period) those running back to back before such a task on its CPU lane
    (`report`: the schedule's validation, when already done)."""
    result = simulate(schedule, costs, report)
    last_compute: dict[int, float] = {}
    for e in result.events:
        if e.resource == "compute":
            last_compute[e.rank] = max(last_compute.get(e.rank, 0.0), e.end)
    margin = 1e-9 * max(result.iteration_time, 1.0)
    tasks = sorted((e for e in result.events if e.resource == "cpu-optimizer"
                    and e.kind == "optimizer" and e.stage >= 0), key=lambda e: (e.rank, e.start))
    selected: set[BackwardStage] = set()
    busy: list = []  # the current busy period of one rank's CPU lane
    for e in [*tasks, None]:
        if busy and (e is None or e.rank != busy[-1].rank or e.start > busy[-1].end + margin):
            late = [t for t in busy if t.end > last_compute.get(t.rank, 0.0) + margin]
            if late:
                selected.update(BackwardStage(t.stage, t.sub) for t in (busy if busy_period
                                                                         else late))
            busy = []
        if e is not None:
            busy.append(e)
    return frozenset(selected)


def with_device_subgroups(schedule: Schedule, stages: frozenset[BackwardStage]) -> Schedule:
    """`schedule` with the OPTIMIZER_START of `stages` turned into
    OPTIMIZER_START_SUBGROUPS (speculative or after the verdict alike)."""
    programs = tuple(
        tuple(Instruction(Op.OPTIMIZER_START_SUBGROUPS, stage=ins.stage, sub=ins.sub)
              if ins.op == Op.OPTIMIZER_START and BackwardStage(ins.stage, ins.sub) in stages
              else ins for ins in program)
        for program in schedule.programs)
    return replace(schedule, programs=tuple(programs))


def startup_costs(schedule: Schedule) -> CostModel:
    """What the runtime can price before it has measured anything: abstract compute units
    (forward 1, backward 2, recompute 1 per forward stage) and a CPU update as long as a
    forward (S Fig. 3's regime, where the optimizer is as slow as a stage's compute)."""
    return uniform_costs(schedule, forward_time=1.0, backward_time=2.0, recompute_time=1.0,
                         optimizer_time=1.0)


def place_device_subgroups(schedule: Schedule, costs: CostModel | None = None,
                           report: ValidationReport | None = None) -> Schedule:
    """`schedule` with device subgroups for the stages whose update would be exposed. The
    placement only renames optimizer starts, so `report` (the schedule's validation, when
    already done) holds for the result too."""
    return with_device_subgroups(
        schedule, exposed_update_stages(schedule, costs or startup_costs(schedule),
                                        report=report))
