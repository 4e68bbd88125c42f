"""Parameters of stages whose owner is on another node.

A backward stage's segment lives on its owner's node. A node where another rank runs that
stage's forward (or, in general, reads the segment) holds a replica: its lowest such rank
creates a segment of the same key in its node's store and receives every published
version from the owner (S section 4 fetches over RDMA; we push over torch.distributed after
each optimizer step). Every rank walks the backward stages in the same order, so the blocking
transfers cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron.offload.multinode import push_parameters, receive_parameters
from megatron.offload.naming import node_of
from megatron.offload.param_store import ParameterStore
from megatron.schedules.instructions import BackwardStage, Op, Schedule


@dataclass(frozen=True)
class Replica:
    backward_stage: BackwardStage
    owner: int
    holders: tuple[int, ...]  # one rank per other node that reads the backward stage


def plan_replicas(schedule: Schedule, procs_per_node: int) -> list[Replica]:
    readers: dict[BackwardStage, set[int]] = {}
    for rank, program in enumerate(schedule.programs):
        for instr in program:
            if instr.op == Op.PREFETCH_PARAMS:
                for backward_stage in schedule.params_of(instr.stage, instr.sub):
                    readers.setdefault(backward_stage, set()).add(rank)
    plan = []
    for backward_stage in schedule.backward_stages():
        owner = schedule.backward_rank[backward_stage]
        by_node: dict[int, int] = {}
        for rank in sorted(readers.get(backward_stage, ())):
            node = node_of(rank, procs_per_node)
            if node != node_of(owner, procs_per_node):
                by_node.setdefault(node, rank)
        if by_node:
            plan.append(Replica(backward_stage, owner, tuple(sorted(by_node.values()))))
    return plan


def global_replicas(plan: list[Replica], global_rank: Callable[[int, int], int]
                    ) -> list[Replica]:
    """A plan made over pipeline ranks, with the first data-parallel replica of each
    owner and holder doing the transfers (`global_rank(pipeline_rank, dp_rank)`)."""
    return [Replica(r.backward_stage, global_rank(r.owner, 0),
                    tuple(global_rank(h, 0) for h in r.holders)) for r in plan]


def holds_segment(plan: list[Replica], rank: int) -> set[BackwardStage]:
    """The replica segments this rank creates (beside the segments of what it owns)."""
    return {r.backward_stage for r in plan if rank in r.holders}


def push_replicas(plan: list[Replica], store: ParameterStore, rank: int,
                  group: dist.ProcessGroup | None = None) -> None:
    """Owners send the published version of each backward stage to its holders, who publish it.
    `group` must move host tensors (gloo)."""
    for replica in plan:
        if rank == replica.owner:
            push_parameters(store.get(replica.backward_stage), list(replica.holders), group=group)
        elif rank in replica.holders:
            receive_parameters(store.get(replica.backward_stage), replica.owner, group=group)
