"""What moving parameters between nodes costs an iteration, simulated.

A stage read on another node than its owner's reaches that node as a replica (the plan in
`replica_plan.py`) once per iteration, after its owner published the new version (the end
of the iteration). Two ways to move them, priced with the cost model's
`inter_node_transfer` (a stage's 16-bit parameters over one node's link):

- "blocking": after the step, every rank's main thread walks the plan and sends or
  receives its replicas before starting the next iteration;
- "per-stage": a thread of each rank walks the plan while the next iteration runs; a
  prefetch on the reading node waits only for the stage it loads.

Both walk the plan in the same order (the stages' forward order) on every rank, a push being
a rendezvous of its owner's and its holder's walks, and each node has one link, each way,
that its pushes share one at a time. The next iteration is then simulated with the
prefetches held until their parameters have arrived (blocking: until the rank's whole walk
is done); the exposed distribution time is how much longer it takes than without them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .cost_model import CostModel
from .instructions import BackwardStage, Schedule
from .replica_plan import node_of, plan_replicas
from .simulator import simulate
from .timeline import TimedEvent
from .validator import ValidationReport, validate

DISTRIBUTION_MODES = ("blocking", "per-stage")


@dataclass(frozen=True)
class DistributionResult:
    mode: str
    iteration_time: float  # the next iteration, distribution included
    exposed_time: float  # how much longer than with every parameter already in place
    link_time: float  # the pushes' transfer time, summed
    transfers: tuple[TimedEvent, ...]  # on the owner's network lane, from the step's end

    def summary(self) -> dict:
        return {"mode": self.mode, "iteration_time": self.iteration_time,
                "exposed_time": self.exposed_time, "link_time": self.link_time,
                "pushes": len(self.transfers)}


def simulate_distribution(schedule: Schedule, costs: CostModel, procs_per_node: int,
                          mode: str, report: ValidationReport | None = None
                          ) -> DistributionResult:
    """Simulate `mode` of distributing the parameters of `schedule` on nodes of
    `procs_per_node` ranks (see the module docstring)."""
    if mode not in DISTRIBUTION_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(DISTRIBUTION_MODES)}")
    if procs_per_node < 1:
        raise ValueError(f"procs_per_node={procs_per_node}: expected >= 1")
    report = report if report is not None else validate(schedule)
    alone = simulate(schedule, costs, report)
    plan = plan_replicas(schedule, procs_per_node)
    if plan and not costs.inter_node_transfer:
        raise ValueError("the cost model prices no inter-node link (a hardware profile "
                         "without inter_node_bytes_per_s, or no inter-node time given)")
    walk_free: dict[int, float] = defaultdict(float)  # per rank
    send_free: dict[int, float] = defaultdict(float)  # per node, each way
    receive_free: dict[int, float] = defaultdict(float)
    arrived: dict[tuple[int, BackwardStage], float] = {}  # (node, stage)
    transfers = []
    for replica in plan:
        b, owner = replica.backward_stage, replica.owner
        for holder in replica.holders:
            source, target = node_of(owner, procs_per_node), node_of(holder, procs_per_node)
            start = max(walk_free[owner], walk_free[holder], send_free[source],
                        receive_free[target])
            end = start + costs.inter_node_transfer[b]
            walk_free[owner] = walk_free[holder] = send_free[source] = end
            receive_free[target] = arrived[(target, b)] = end
            transfers.append(TimedEvent(owner, "network", start, end, f"d{b[0]},{b[1]}",
                                        "distribution", b[0], b[1]))
    stages = schedule.backward_stages()
    if mode == "blocking":
        arrive = {(rank, b): walk_free[rank] for rank in range(schedule.ranks) for b in stages}
    else:
        arrive = {(rank, b): arrived[(node_of(rank, procs_per_node), b)]
                  for rank in range(schedule.ranks) for b in stages
                  if (node_of(rank, procs_per_node), b) in arrived}
    following = simulate(schedule, costs, report, params_arrive=arrive)
    return DistributionResult(
        mode=mode, iteration_time=following.iteration_time,
        exposed_time=following.iteration_time - alone.iteration_time,
        link_time=sum(e.end - e.start for e in transfers), transfers=tuple(transfers))
