"""Turns per-rank compute orders into complete programs.

A schedule generator only decides, for each rank, the order of its FORWARD and BACKWARD
instructions. This module adds everything else the same way for every schedule:

- communication: every tensor that crosses ranks gets a matched send/receive. Blocking
  pairs are placed at a rendezvous time taken from a reference timeline (forward 1,
  backward stage `backward_ratio / d`, no transfer cost), and each rank issues its
  blocking communications in increasing (time, sender parity, tensor) order. One global
  order that every rank follows cannot deadlock under rendezvous semantics: the earliest
  pending pair always has both sides ready. Even senders first makes the pairs of a chain
  r -> r+1 -> ... that meet at the same time run in two rounds instead of one by one.
  Activation checkpoints go asynchronously: ISEND right after the forward, IRECV at the
  same step on the receiver, WAIT right before the backward that recomputes from it.
  Every transfer of an ordered pair of ranks, blocking or not, is sorted by the same
  (time, sender parity, tensor) key on both sides, so the sender posts its sends in the
  order the receiver posts its receives (NCCL matches them by that order, not by tag).
- parameters: consecutive compute on the same parameters forms a segment; the next
  segment is prefetched when a segment starts and a segment is released when it ends, so
  at most two segments are resident (a double buffer).
- gradients: OFFLOAD_GRAD after a backward stage's last micro-batch on its owner; the
  optimizer either starts right away (post-step overflow check) or after a synchronized
  overflow check at the end.
- optimizer states on NVMe (place_state_io): each step's read ahead of it, its write
  right after it, within a window of stages held in host memory.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

from .instructions import WHOLE_STAGE, Instruction, Op, Schedule

SYNCHRONOUS_OPTIMIZER = "synchronous"  # overflow check + all-reduce, then every step
POST_STEP_OPTIMIZER = "post-step"  # step as soon as gradients are home; check after
NO_OPTIMIZER = "none"  # forward-only (evaluation) programs

# Priorities of instructions that share a gap between two compute instructions.
_AFTER_COMPUTE, _PREFETCH, _COMM, _WAIT, _COMPUTE = range(5)


def _forward(stage: int, mb: int) -> Instruction:
    return Instruction(Op.FORWARD, stage=stage, mb=mb)


def _backward(stage: int, sub: int, mb: int) -> Instruction:
    return Instruction(Op.BACKWARD, stage=stage, sub=sub, mb=mb)


def transfers(shape: Schedule):
    """Yield (role, key, producer, producer_rank, consumer, consumer_rank) of every tensor
    (of a forward-only schedule: the activations only)."""
    d = 0 if shape.forward_only else shape.backward_split
    for mb in range(shape.micro_batches):
        for stage in range(shape.forward_stages):
            forward = _forward(stage, mb)
            if stage + 1 < shape.forward_stages:
                yield ("act", (stage, -1, mb), forward, shape.forward_rank[stage],
                       _forward(stage + 1, mb), shape.forward_rank[stage + 1])
            for sub in range(d):
                if (stage, sub) != (0, 0):  # stage 0's input is the token batch
                    yield ("ckpt", (stage, sub, mb), forward, shape.forward_rank[stage],
                           _backward(stage, sub, mb), shape.backward_rank[(stage, sub)])
                previous = shape.previous_backward_stage((stage, sub))
                if previous is not None:
                    yield ("grad", (stage, sub, mb), _backward(stage, sub, mb),
                           shape.backward_rank[(stage, sub)], _backward(*previous, mb),
                           shape.backward_rank[previous])


def reference_timeline(
    shape: Schedule, orders: list[list[Instruction]], backward_ratio: float
) -> dict:
    """{compute instruction: (start, end)} by list scheduling: a forward costs 1 and a
    backward stage backward_ratio / d (its recompute included)."""
    duration = {Op.FORWARD: 1.0, Op.BACKWARD: backward_ratio / shape.backward_split}
    deps = defaultdict(list)
    for _, _, producer, _, consumer, _ in transfers(shape):
        deps[consumer].append(producer)
    times: dict = {}
    position = [0] * shape.ranks
    free = [0] * shape.ranks
    pending = sum(len(order) for order in orders)
    while pending:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                op = order[position[rank]]
                if any(dep not in times for dep in deps[op]):
                    break
                start = max([free[rank]] + [times[dep][1] for dep in deps[op]])
                times[op] = (start, start + duration[op.op])
                free[rank] = times[op][1]
                position[rank] += 1
                pending -= 1
                progressed = True
        if not progressed:
            stuck = {rank: str(order[position[rank]]) for rank, order in enumerate(orders)
                     if position[rank] < len(order)}
            raise RuntimeError(f"compute orders wait on each other: {stuck}")
    return times


class _RankTimeline:
    """Start/end times of one rank's compute, to map a time to a gap between ops."""

    def __init__(self, order: list[Instruction], times: dict) -> None:
        self.starts = [times[op][0] for op in order]
        self.ends = [times[op][1] for op in order]

    def gap(self, time: float) -> int:
        """Index of the first compute instruction that starts at or after `time`."""
        return bisect_left(self.starts, time)

    def busy_until(self, time: float) -> float | None:
        index = bisect_left(self.starts, time) - 1
        if index >= 0 and self.ends[index] > time:
            return self.ends[index]
        return None


def _rendezvous(
    sender: _RankTimeline, receiver: _RankTimeline, ready: float, due: float
) -> float:
    """Earliest time >= ready at which both ranks are between compute instructions.

    Falls back to `ready` when that time would be after the consumer's start `due` (the
    sender then waits for the receiver, which is slower but still deadlock-free).
    """
    time = ready
    while True:
        later = receiver.busy_until(time) or sender.busy_until(time)
        if later is None:
            return time if time <= due else ready
        time = later


def _param_segments(shape: Schedule, order: list[Instruction]) -> list[tuple[frozenset, int, int]]:
    """(pieces, first index, last index) of runs of compute using the same parameters."""
    segments: list[tuple[frozenset, int, int]] = []
    for index, op in enumerate(order):
        sub = WHOLE_STAGE if op.op == Op.FORWARD else op.sub
        pieces = frozenset(shape.params_of(op.stage, sub))
        if segments and segments[-1][0] == pieces:
            segments[-1] = (pieces, segments[-1][1], index)
        else:
            segments.append((pieces, index, index))
    return segments


def _param_instructions(shape: Schedule, op: Op, pieces: frozenset) -> list[Instruction]:
    """PREFETCH/RELEASE instructions covering `pieces`: whole stages where possible."""
    instructions = []
    for stage in sorted({stage for stage, _ in pieces}):
        subs = sorted(sub for piece_stage, sub in pieces if piece_stage == stage)
        if len(subs) == shape.backward_split:
            instructions.append(Instruction(op, stage=stage, sub=WHOLE_STAGE))
        else:
            instructions += [Instruction(op, stage=stage, sub=sub) for sub in subs]
    return instructions


class _Placement:
    """Instructions of each rank keyed by (gap before compute #gap, priority, order key)."""

    def __init__(self, ranks: int) -> None:
        self.items: list[list[tuple]] = [[] for _ in range(ranks)]

    def put(self, rank: int, gap: int, priority: int, key: tuple, ins: Instruction) -> None:
        self.items[rank].append((gap, priority, key, ins))

    def programs(self) -> tuple[tuple[Instruction, ...], ...]:
        return tuple(
            tuple(ins for *_, ins in sorted(rank_items, key=lambda item: item[:3]))
            for rank_items in self.items
        )


def _place_transfers(shape: Schedule, orders: list[list[Instruction]], times: dict,
                     placement: _Placement) -> None:
    timelines = [_RankTimeline(order, times) for order in orders]
    index_of = {op: i for order in orders for i, op in enumerate(order)}
    for role, (stage, sub, mb), producer, src, consumer, dst in transfers(shape):
        if src == dst:
            continue
        produced = times[producer][1]
        if role == "ckpt":
            key = (produced, src % 2, role, stage, sub, mb)
            # Same priority and key as every other transfer of the pair, on both sides:
            # NCCL matches sends and receives between two ranks by posting order.
            placement.put(src, index_of[producer] + 1, _COMM, key,
                          Instruction(Op.ISEND_CKPT, stage=stage, sub=sub, mb=mb, peer=dst))
            placement.put(dst, timelines[dst].gap(produced), _COMM, key,
                          Instruction(Op.IRECV_CKPT, stage=stage, sub=sub, mb=mb, peer=src))
            placement.put(dst, index_of[consumer], _WAIT, key,
                          Instruction(Op.WAIT_CKPT, stage=stage, sub=sub, mb=mb, peer=src))
            continue
        meet = _rendezvous(timelines[src], timelines[dst], produced, times[consumer][0])
        # Pairs meeting at the same time along a chain r -> r+1 -> ... would run one after
        # another; ordering even senders first lets them run in two rounds (odd-even).
        key = (meet, src % 2, role, stage, sub, mb)
        send, recv = (Op.SEND_ACT, Op.RECV_ACT) if role == "act" else (Op.SEND_GRAD, Op.RECV_GRAD)
        placement.put(src, timelines[src].gap(meet), _COMM, key,
                      Instruction(send, stage=stage, sub=sub, mb=mb, peer=dst))
        placement.put(dst, timelines[dst].gap(meet), _COMM, key,
                      Instruction(recv, stage=stage, sub=sub, mb=mb, peer=src))


def _place_parameters(shape: Schedule, rank: int, order: list[Instruction],
                      placement: _Placement) -> None:
    """Double buffer: fetch segment j+1 when segment j starts, drop j when it ends; pieces
    shared by neighbouring segments stay resident."""
    segments = _param_segments(shape, order) + [(frozenset(), len(order), len(order))]
    for number, (pieces, first, last) in enumerate(segments[:-1]):
        following = segments[number + 1][0]
        fetches = [(pieces, 0)] if number == 0 else []
        fetches.append((following - pieces, 1))
        for needed, slot in fetches:
            for key, ins in enumerate(_param_instructions(shape, Op.PREFETCH_PARAMS, needed)):
                placement.put(rank, first, _PREFETCH, (slot, key), ins)
        released = _param_instructions(shape, Op.RELEASE_PARAMS, pieces - following)
        for key, ins in enumerate(released):
            placement.put(rank, last + 1, _AFTER_COMPUTE, (2, key), ins)


def _place_optimizer(rank: int, order: list[Instruction], mode: str,
                     placement: _Placement) -> None:
    last_backward = {}
    for index, op in enumerate(order):
        if op.op == Op.BACKWARD:
            last_backward[(op.stage, op.sub)] = index
    offloads = sorted(last_backward.items(), key=lambda item: item[1])
    for (stage, sub), index in offloads:
        placement.put(rank, index + 1, _AFTER_COMPUTE, (0,),
                      Instruction(Op.OFFLOAD_GRAD, stage=stage, sub=sub))
        if mode == POST_STEP_OPTIMIZER:
            placement.put(rank, index + 1, _AFTER_COMPUTE, (1,),
                          Instruction(Op.OPTIMIZER_START, stage=stage, sub=sub))
    end = len(order) + 1
    if mode == NO_OPTIMIZER:
        if offloads:
            raise ValueError("a program with backwards needs an optimizer phase")
        return
    if mode == SYNCHRONOUS_OPTIMIZER:
        tail = [Instruction(Op.OVERFLOW_SYNC)]
        tail += [Instruction(Op.OPTIMIZER_START, stage=stage, sub=sub)
                 for (stage, sub), _ in offloads]
        tail += [Instruction(Op.OPTIMIZER_WAIT_ALL)]
    elif mode == POST_STEP_OPTIMIZER:
        tail = [Instruction(Op.OPTIMIZER_WAIT_ALL), Instruction(Op.POST_STEP_SYNC),
                Instruction(Op.ROLLBACK_IF_OVERFLOW)]
    else:
        raise ValueError(f"unknown optimizer mode {mode!r}")
    for number, ins in enumerate(tail):
        placement.put(rank, end, 0, (number,), ins)


def build_programs(
    shape: Schedule, orders: list[list[Instruction]], optimizer_mode: str,
    backward_ratio: float,
) -> tuple[tuple[Instruction, ...], ...]:
    """Complete programs for every rank from the compute orders (see module docstring).

    backward_ratio (backward + recompute of a stage over its forward) only shapes where
    blocking transfers sit; the programs are deadlock-free for any real costs.
    """
    times = reference_timeline(shape, orders, backward_ratio)
    placement = _Placement(shape.ranks)
    _place_transfers(shape, orders, times, placement)
    for rank, order in enumerate(orders):
        for index, op in enumerate(order):
            placement.put(rank, index, _COMPUTE, (), op)
        _place_parameters(shape, rank, order, placement)
        _place_optimizer(rank, order, optimizer_mode, placement)
    return placement.programs()


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The evaluation counterpart of `schedule` (generated or read from a file): each rank's
    forwards in the same order, on the same ranks, lowered like every program (activation
    transfers, parameter double buffer) but with no backward, no activation checkpoint and
    no optimizer phase."""
    orders = [[ins for ins in program if ins.op == Op.FORWARD] for program in schedule.programs]
    shape = Schedule(**{**vars(schedule), "programs": (), "forward_only": True})
    return Schedule(**{**vars(shape), "programs": build_programs(shape, orders, NO_OPTIMIZER, 1.0)})


def place_state_io(schedule: Schedule, window: int = 2) -> Schedule:
    """`schedule` with its optimizer states on NVMe: each owned stage's
    READ_OPTIMIZER_STATES before its first backward (the read hides behind the stage's
    backwards), but not before the WRITE of the stage stepped `window` starts earlier (at
    most `window` stages' states in host memory), and its WRITE_OPTIMIZER_STATES right
    after its OPTIMIZER_START. A program that already holds them (a schedule file) is
    returned as it is."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1 stage")
    if schedule.states_on_disk:
        return schedule
    programs = []
    for program in schedule.programs:
        first_backward: dict[tuple[int, int], int] = {}
        starts: list[tuple[int, Instruction]] = []
        for index, ins in enumerate(program):
            if ins.op == Op.BACKWARD:
                first_backward.setdefault((ins.stage, ins.sub), index)
            elif ins.op in (Op.OPTIMIZER_START, Op.OPTIMIZER_START_SUBGROUPS):
                starts.append((index, ins))
        keyed = [((index, 1), ins) for index, ins in enumerate(program)]
        for j, (index, start) in enumerate(starts):
            b = (start.stage, start.sub)
            read_key = (first_backward.get(b, index), 0, j)
            if j >= window:  # after the write that frees a window buffer
                read_key = max(read_key, (starts[j - window][0], 3, j))
            keyed.append((read_key, Instruction(Op.READ_OPTIMIZER_STATES, *b)))
            keyed.append(((index, 2), Instruction(Op.WRITE_OPTIMIZER_STATES, *b)))
        programs.append(tuple(ins for _, ins in sorted(keyed, key=lambda item: item[0])))
    return Schedule(**{**vars(schedule), "programs": tuple(programs)})
