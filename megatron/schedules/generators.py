"""Schedule generators: gpipe, 1f1b, interleaved-1f1b, mobius and decoupled (SysX).

Each schedule is one entry of `SCHEDULE_KINDS`: its stage-to-rank assignment, every
rank's order of FORWARD and BACKWARD instructions, and the traits the planner, the
lowering and the checks ask of it (stages per rank, whether backward stages split,
whether the optimizer overlaps). Nothing outside this module compares schedule names.
`lowering.build_programs` adds communication, parameter movement and the optimizer in
the same way for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .instructions import BackwardStage, Instruction, Op, Schedule
from .lowering import POST_STEP_OPTIMIZER, SYNCHRONOUS_OPTIMIZER, build_programs
from .partition import check_partition, sub_stage_layers

Orders = list[list[Instruction]]
Assignment = dict[BackwardStage, int]  # the rank that runs each backward stage

# Expected (backward + recompute) / forward time of a stage, used to place blocking
# transfers: 2 in SysX's figures (the recompute not drawn); a real run recomputes the
# whole forward, so its backward is about three forwards.
PAPER_BACKWARD_RATIO = 2.0
RECOMPUTE_BACKWARD_RATIO = 3.0

# A schedule is a list of Python objects per rank: about 5 instructions (transfers, prefetch,
# release, offload and optimizer around them) per FORWARD or BACKWARD, each built, validated
# and simulated in Python (about 0.3 ms per compute instruction in all). The bound, checked
# before anything is built, keeps an absurd size from taking minutes and GBs: at the limit a
# schedule takes under a minute. Real shapes are far below it (S=32, d=2, M=1024: 98k).
MAX_COMPUTE_INSTRUCTIONS = 100_000


class ScheduleTooLarge(ValueError):
    """The schedule would have more compute instructions than MAX_COMPUTE_INSTRUCTIONS."""


def compute_instructions(forward_stages: int, backward_split: int, micro_batches: int,
                         forward_only: bool = False) -> int:
    """FORWARD and BACKWARD instructions of one iteration of every rank together."""
    return forward_stages * micro_batches * (1 if forward_only else 1 + backward_split)


def check_schedule_size(forward_stages: int, backward_split: int, micro_batches: int) -> None:
    """Raise ScheduleTooLarge, saying the limit and why, before any structure is built."""
    count = compute_instructions(forward_stages, backward_split, micro_batches)
    if count > MAX_COMPUTE_INSTRUCTIONS:
        raise ScheduleTooLarge(
            f"{forward_stages} forward stages x {micro_batches} micro-batches x (1 + "
            f"backward split {backward_split}) = {count} FORWARD/BACKWARD instructions per "
            f"iteration, expected at most {MAX_COMPUTE_INSTRUCTIONS} (the programs are built "
            "in memory, about 5 instructions each)")


def _f(stage: int, mb: int) -> Instruction:
    return Instruction(Op.FORWARD, stage=stage, mb=mb)


def _b(stage: int, sub: int, mb: int) -> Instruction:
    return Instruction(Op.BACKWARD, stage=stage, sub=sub, mb=mb)


def coupled_assignment(ranks: int, forward_stages: int, backward_split: int) -> Assignment:
    """Each stage's backward on the rank of its forward (stage i on rank i mod R)."""
    return {(stage, 0): stage % ranks for stage in range(forward_stages)}


def _gpipe_orders(ranks: int, micro_batches: int) -> Orders:
    """All forwards, then all backwards, one stage per rank (SysX Fig. 1a)."""
    return [
        [_f(r, mb) for mb in range(micro_batches)] + [_b(r, 0, mb) for mb in range(micro_batches)]
        for r in range(ranks)
    ]


def _one_f_one_b(forwards: list[Instruction], backwards: list[Instruction], warmup: int):
    """Warm-up forwards, then alternate one forward and one backward, then drain."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup:]


def _1f1b_orders(ranks: int, micro_batches: int) -> Orders:
    """DAPPLE's one-forward-one-backward (SysX Fig. 1b): rank r warms up with R-r-1."""
    return [
        _one_f_one_b(
            [_f(r, mb) for mb in range(micro_batches)],
            [_b(r, 0, mb) for mb in range(micro_batches)],
            ranks - r - 1,
        )
        for r in range(ranks)
    ]


def _interleaved_orders(ranks: int, chunks: int, micro_batches: int) -> Orders:
    """Megatron's interleaved 1F1B: chunk c of rank r is stage c*R + r; micro-batches go
    through all chunks in groups of R; warm-up is (R-r-1)*2 + (chunks-1)*R."""
    if chunks == 1:
        return _1f1b_orders(ranks, micro_batches)
    orders = []
    for r in range(ranks):
        forwards, backwards = [], []
        for group in range(0, micro_batches, ranks):
            for c in range(chunks):
                for mb in range(group, group + ranks):
                    forwards.append(_f(c * ranks + r, mb))
                    backwards.append(_b((chunks - 1 - c) * ranks + r, 0, mb))
        warmup = (ranks - r - 1) * 2 + (chunks - 1) * ranks
        orders.append(_one_f_one_b(forwards, backwards, warmup))
    return orders


def _interleaved_forwards(rank: int, ranks: int, stages: int, micro_batches: int):
    """Interleaved AFAB forward: the rank's stages r, r+R, ... each for every micro-batch."""
    return [_f(stage, mb) for stage in range(rank, stages, ranks) for mb in range(micro_batches)]


def _mobius_orders(ranks: int, stages: int, micro_batches: int) -> Orders:
    """Interleaved AFAB with coupled assignment (SysX Fig. 2)."""
    return [
        _interleaved_forwards(r, ranks, stages, micro_batches)
        + [_b(stage, 0, mb) for stage in reversed(range(r, stages, ranks))
           for mb in range(micro_batches)]
        for r in range(ranks)
    ]


def decoupled_assignment(ranks: int, forward_stages: int, backward_split: int) -> Assignment:
    """Backward stages in reverse model order go round-robin to ranks 0, 1, 2, ... (SysX 3.1)."""
    reverse = [(i, k) for i in reversed(range(forward_stages)) for k in reversed(range(backward_split))]
    return {piece: index % ranks for index, piece in enumerate(reverse)}


def _decoupled_orders(ranks: int, stages: int, micro_batches: int,
                      backward_rank: Assignment) -> Orders:
    """Interleaved AFAB forward, then each rank's backward stages in reverse model order."""
    owned: list[list[BackwardStage]] = [[] for _ in range(ranks)]
    for piece, owner in backward_rank.items():  # once over the pieces: linear in the ranks
        owned[owner].append(piece)
    orders = []
    for r in range(ranks):
        pieces = sorted(owned[r], reverse=True)
        orders.append(
            _interleaved_forwards(r, ranks, stages, micro_batches)
            + [_b(stage, sub, mb) for stage, sub in pieces for mb in range(micro_batches)]
        )
    return orders


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_common(name: str, ranks: int, stages: int, split: int, micro_batches: int) -> None:
    for flag, value in (("ranks", ranks), ("forward_stages", stages),
                        ("backward_split", split), ("micro_batches", micro_batches)):
        _require(isinstance(value, int) and value >= 1,
                 f"{flag} is {value!r}, expected an integer >= 1")
    kind = schedule_kind(name)
    if kind.one_stage_per_rank:
        _require(stages == ranks,
                 f"forward_stages is {stages}, {name} expects one stage per rank ({ranks})")
    else:
        _require(stages % ranks == 0,
                 f"forward_stages is {stages}, expected a multiple of ranks ({ranks})")
    if not kind.splits_backward:
        _require(split == 1, f"backward_split is {split}, {name} expects 1 (coupled stages)")
    check_schedule_size(stages, split, micro_batches)
    if kind.micro_batches_in_rank_groups and stages > ranks:
        _require(micro_batches % ranks == 0,
                 f"micro_batches is {micro_batches}, {name} expects a multiple of "
                 f"ranks ({ranks}) as Megatron does")


def build_schedule(
    name: str,
    ranks: int,
    forward_stages: int,
    backward_split: int,
    micro_batches: int,
    partition: list[int] | tuple[int, ...] | None = None,
    backward_ratio: float = PAPER_BACKWARD_RATIO,
    lower: bool = True,
) -> Schedule:
    """One training iteration of schedule `name` for every rank.

    partition: decoder layers per forward stage; by default every stage has
    `backward_split` layers (the smallest uniform model the split allows).
    backward_ratio: expected (backward + recompute) / forward time of a stage; it decides
    where blocking sends/receives sit so that they rarely stall (2 as in SysX's figures;
    3 when the recompute is a full extra forward). Any value gives a valid schedule.
    lower: False gives the shape only (assignment and partition, no programs), checked the
    same way: what a planner can bound before paying for the programs.
    Raises ValueError with a one-line message on inconsistent arguments (ScheduleTooLarge
    on a size past MAX_COMPUTE_INSTRUCTIONS).
    """
    _check_common(name, ranks, forward_stages, backward_split, micro_batches)
    if not backward_ratio > 0:
        raise ValueError(f"backward_ratio is {backward_ratio!r}, expected a number > 0")
    partition = tuple(partition) if partition is not None else (backward_split,) * forward_stages
    check_partition(partition, forward_stages)
    sub_stage_layers(partition, backward_split)  # rejects d larger than a stage's layers
    kind = SCHEDULE_KINDS[name]
    forward_rank = tuple(stage % ranks for stage in range(forward_stages))
    backward_rank = kind.assignment(ranks, forward_stages, backward_split)
    shape = Schedule(name, ranks, forward_stages, backward_split, micro_batches, partition,
                     forward_rank, backward_rank, programs=())
    if not lower:
        return shape
    orders = kind.orders(ranks, forward_stages, micro_batches, backward_rank)
    return Schedule(**{**vars(shape), "programs": build_programs(shape, orders,
                                                                 kind.optimizer_mode,
                                                                 backward_ratio)})


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule: how it is generated and what the planner, the lowering and the checks
    ask of it. Adding a schedule is one entry in SCHEDULE_KINDS (and its orders function)."""

    name: str
    # each rank's FORWARD/BACKWARD order: (ranks, forward stages, micro-batches, assignment)
    orders: Callable[[int, int, int, Assignment], Orders]
    # which rank runs each backward stage: (ranks, forward stages, backward split)
    assignment: Callable[[int, int, int], Assignment] = coupled_assignment
    # True: exactly one forward stage per rank; False: any multiple of the ranks
    one_stage_per_rank: bool = False
    # the forward stages per rank --auto-config tries
    searched_stages_per_rank: tuple[int, ...] = (1, 2, 3, 4)
    # a forward stage may be split into d > 1 backward stages (--backward-split)
    splits_backward: bool = False
    # each stage steps as soon as its gradients are home, checked after the step, instead
    # of an overflow check and all-reduce after every rank's backward
    optimizer_overlaps: bool = False
    # with several stages per rank, micro-batches go through the stages in groups of R
    micro_batches_in_rank_groups: bool = False

    @property
    def optimizer_mode(self) -> str:
        """The lowering's optimizer mode for this schedule's programs."""
        return POST_STEP_OPTIMIZER if self.optimizer_overlaps else SYNCHRONOUS_OPTIMIZER


SCHEDULE_KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in (
    ScheduleKind("gpipe", lambda ranks, stages, mbs, _: _gpipe_orders(ranks, mbs),
                 one_stage_per_rank=True, searched_stages_per_rank=(1,)),
    ScheduleKind("1f1b", lambda ranks, stages, mbs, _: _1f1b_orders(ranks, mbs),
                 one_stage_per_rank=True, searched_stages_per_rank=(1,)),
    ScheduleKind("interleaved-1f1b",
                 lambda ranks, stages, mbs, _: _interleaved_orders(ranks, stages // ranks, mbs),
                 searched_stages_per_rank=(2, 3, 4),  # one per rank is 1f1b
                 micro_batches_in_rank_groups=True),
    ScheduleKind("mobius", lambda ranks, stages, mbs, _: _mobius_orders(ranks, stages, mbs)),
    ScheduleKind("decoupled", _decoupled_orders, assignment=decoupled_assignment,
                 splits_backward=True, optimizer_overlaps=True),
)}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULE_KINDS)
DEFAULT_SCHEDULE = "decoupled"  # what a pipeline runs when no schedule is named (SysX)


def schedule_kind(name: str) -> ScheduleKind:
    """The registry entry of schedule `name` (ValueError naming the known ones)."""
    _require(name in SCHEDULE_KINDS,
             f"schedule {name!r} is unknown, expected one of {', '.join(SCHEDULE_NAMES)}")
    return SCHEDULE_KINDS[name]
