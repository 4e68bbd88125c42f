"""Which stages cross nodes: for every backward stage read on a node other than its
owner's, one rank per such node holds a replica of its parameters (the lowest rank there
that prefetches it). Pure: the runtime pushes along this plan, the distribution model
(`distribution.py`) prices it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .instructions import BackwardStage, Op, Schedule


def node_of(rank: int, procs_per_node: int) -> int:
    """Node index of a global rank when ranks fill nodes in order (torchrun's layout)."""
    if rank < 0:
        raise ValueError(f"rank={rank}: expected a non-negative rank")
    return rank // procs_per_node


@dataclass(frozen=True)
class Replica:
    backward_stage: BackwardStage
    owner: int
    holders: tuple[int, ...]  # one rank per other node that reads the backward stage


def plan_replicas(schedule: Schedule, procs_per_node: int) -> list[Replica]:
    """The replicas, in the forward order of their stages (the order the next iteration
    needs them, and the order every rank walks them in)."""
    readers: dict[BackwardStage, set[int]] = {}
    for rank, program in enumerate(schedule.programs):
        for instr in program:
            if instr.op == Op.PREFETCH_PARAMS:
                for backward_stage in schedule.params_of(instr.stage, instr.sub):
                    readers.setdefault(backward_stage, set()).add(rank)
    plan = []
    for backward_stage in sorted(schedule.backward_stages()):  # forward order
        owner = schedule.backward_rank[backward_stage]
        by_node: dict[int, int] = {}
        for rank in sorted(readers.get(backward_stage, ())):
            node = node_of(rank, procs_per_node)
            if node != node_of(owner, procs_per_node):
                by_node.setdefault(node, rank)
        if by_node:
            plan.append(Replica(backward_stage, owner, tuple(sorted(by_node.values()))))
    return plan
