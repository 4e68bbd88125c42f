"""How large each of a rank's parameter slots must be: the runtime's device buffers for the
backward stages' parameters (megatron/offload/prefetch.py `ParamSlots`), sized from the
rank's programs before anything is allocated; the memory model prices the same sizes.

A PREFETCH_PARAMS puts each backward stage it covers into the free slot of lowest index
(ParamSlots' rule), a RELEASE_PARAMS frees it, and every slot is free again after a
program (the executor releases what is left). Each slot is then as large as the largest
stage it takes, rather than every slot as large as the rank's largest stage: the stages
with the embedding or the output layer are up to half again as large as a layer's, and
only the slots that take them pay for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .instructions import BackwardStage, Op, Schedule

MIN_SLOTS = 2  # the double buffer: one slot computes while the next is filled


def slot_numels(schedules: Sequence[Schedule], rank: int,
                numel: Mapping[BackwardStage, int]) -> tuple[int, ...]:
    """Elements of each slot that `rank`'s programs of `schedules` (run one after the
    other, from empty slots) need, with `numel` elements per backward stage; at least
    MIN_SLOTS slots, those no program fills as large as the largest stage the programs use.
    Before any program exists (a schedule's shape), the least any program needs: one slot
    for the largest stage in `numel`, one for the smallest."""
    if not any(schedule.programs for schedule in schedules):
        return (max(numel.values(), default=0), min(numel.values(), default=0))
    sizes: list[int] = []
    used: set[BackwardStage] = set()
    for schedule in schedules:
        held: list[BackwardStage | None] = [None] * len(sizes)
        for ins in schedule.programs[rank] if schedule.programs else ():
            if ins.op not in (Op.PREFETCH_PARAMS, Op.RELEASE_PARAMS):
                continue
            for b in schedule.params_of(ins.stage, ins.sub):
                if ins.op == Op.RELEASE_PARAMS:
                    if b in held:
                        held[held.index(b)] = None
                    continue
                if b in held:
                    continue
                if None not in held:
                    held.append(None)
                    sizes.append(0)
                slot = held.index(None)
                held[slot] = b
                sizes[slot] = max(sizes[slot], numel[b])
                used.add(b)
    largest = max((numel[b] for b in used), default=0)
    return tuple(sizes + [largest] * (MIN_SLOTS - len(sizes)))
