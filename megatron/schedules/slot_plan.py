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

from collections.abc import Iterator, Mapping, Sequence

from .instructions import BackwardStage, Op, Schedule

MIN_SLOTS = 2  # the double buffer: one slot computes while the next is filled


def _fills(schedule: Schedule, rank: int) -> Iterator[tuple[int, Op, BackwardStage, int]]:
    """Each slot event of `rank`'s program, from empty slots, as ParamSlots serves it:
    (program index, PREFETCH_PARAMS or RELEASE_PARAMS, backward stage, slot index)."""
    held: list[BackwardStage | None] = []
    for index, ins in enumerate(schedule.programs[rank] if schedule.programs else ()):
        if ins.op not in (Op.PREFETCH_PARAMS, Op.RELEASE_PARAMS):
            continue
        for b in schedule.params_of(ins.stage, ins.sub):
            if ins.op == Op.RELEASE_PARAMS:
                if b in held:
                    slot = held.index(b)
                    held[slot] = None
                    yield index, ins.op, b, slot
                continue
            if b in held:
                continue
            if None not in held:
                held.append(None)
            slot = held.index(None)
            held[slot] = b
            yield index, ins.op, b, slot


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
        for _, op, b, slot in _fills(schedule, rank):
            if op == Op.PREFETCH_PARAMS:
                sizes += [0] * (slot + 1 - len(sizes))
                sizes[slot] = max(sizes[slot], numel[b])
                used.add(b)
    largest = max((numel[b] for b in used), default=0)
    return tuple(sizes + [largest] * (MIN_SLOTS - len(sizes)))


def _last_releases(schedule: Schedule, rank: int) -> list[tuple[int, BackwardStage, int]]:
    """(program index, backward stage, slot) of each release after which its slot is filled
    no more in `rank`'s program."""
    events = list(_fills(schedule, rank))
    last_fill = {slot: index for index, op, _, slot in events if op == Op.PREFETCH_PARAMS}
    return [(index, b, slot) for index, op, b, slot in events
            if op == Op.RELEASE_PARAMS and index > last_fill[slot]]


def slots_given_back(schedule: Schedule, rank: int) -> dict[int, tuple[BackwardStage, ...]]:
    """Program index of each RELEASE_PARAMS after which a slot is filled no more in the
    program -> the backward stages whose slots it so frees. The runtime gives such a
    slot's memory back there (the forward's slots are idle through the backward, where
    the checkpoints and the recompute peak) and allocates it again at its next fill, the
    next program's."""
    back: dict[int, tuple[BackwardStage, ...]] = {}
    for index, b, _ in _last_releases(schedule, rank):
        back[index] = back.get(index, ()) + (b,)
    return back


def slot_elements_held(schedule: Schedule, rank: int, sizes: Sequence[int]) -> list[int]:
    """Elements of the slots (of `sizes`) allocated after each instruction of `rank`'s
    program, each given back where `slots_given_back` says (allocated from the program's
    start: the first iteration's, the most)."""
    freed = [0] * len(schedule.programs[rank])
    for index, _, slot in _last_releases(schedule, rank):
        freed[index] += sizes[slot]
    held, total = [], sum(sizes)
    for amount in freed:
        total -= amount
        held.append(total)
    return held
