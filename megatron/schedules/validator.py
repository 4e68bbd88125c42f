"""Checks a schedule before anything runs it, and reports its memory bounds.

`validate(schedule)` executes the programs symbolically with blocking-communication
semantics (see interpreter.py) and raises ScheduleError, naming the rank, the instruction
and the rule, at the first violation of:
- every forward and backward (stage, micro-batch) exactly once, on its assigned rank;
- inputs produced before use: parameters prefetched before compute, the stage input
  activation, the checkpoint (local, or received and waited on) and the incoming gradient;
- gradients complete before their offload, offload before the optimizer, and either a
  synchronized overflow check before every optimizer step or a post-step sync + rollback;
- every send matched by a receive, no deadlock, every produced tensor used, every
  prefetched parameter released by the end.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .instructions import Instruction, Op, Schedule
from .interpreter import RULE_MATCHED, Interpreter, ScheduleError

RULE_ONCE = "every forward and backward exactly once"
RULE_ASSIGNMENT = "compute on its assigned rank"
RULE_PARAMS = "parameters prefetched before compute"
RULE_INPUT = "inputs produced before use"
RULE_POSTED = "checkpoint receive posted before its wait"
RULE_GRADIENTS = "gradients complete before offload"
RULE_OPTIMIZER = "optimizer step after offload and overflow check"
RULE_RESIDENCY = "parameters prefetched when absent, released when resident and by the end"
RULE_DANGLING = "every produced tensor used"


@dataclass(frozen=True)
class ValidationReport:
    """Resident bounds per rank: parameter pieces (backward stages) and checkpoints.

    peak_params[r] counts backward stages' parameters resident at once on rank r (a whole
    forward stage counts `backward_split`); peak_checkpoints[r] counts activation
    checkpoints held (kept for a local backward, or received/being received).
    """

    instructions: tuple[int, ...]
    peak_params: tuple[int, ...]
    peak_checkpoints: tuple[int, ...]

    def peak_params_in_stages(self, backward_split: int) -> tuple[float, ...]:
        return tuple(count / backward_split for count in self.peak_params)


class _Checker(Interpreter):
    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        ranks = range(schedule.ranks)
        self.resident = [set() for _ in ranks]
        self.tensors = [set() for _ in ranks]  # available tensor keys per rank
        self.posted_irecvs = [set() for _ in ranks]
        self.peak_params = [0 for _ in ranks]
        self.peak_ckpts = [0 for _ in ranks]
        self.computed: set[Instruction] = set()
        self.backward_counts = [Counter() for _ in ranks]
        self.offloaded: dict = {}
        self.stepped: dict = {}
        self.synced = [False for _ in ranks]
        self.waited_all = [False for _ in ranks]
        self.post_synced = [False for _ in ranks]
        self.waited: set[tuple] = set()
        self.post_step_mode = [
            any(ins.op == Op.POST_STEP_SYNC for ins in program) for program in schedule.programs
        ]

    def _fail(self, rank: int, index: int, ins: Instruction, rule: str, detail: str):
        raise ScheduleError(rank, index, ins, rule, detail)

    def _take(self, rank: int, index: int, ins: Instruction, key: tuple, what: str) -> None:
        if key not in self.tensors[rank]:
            self._fail(rank, index, ins, RULE_INPUT, f"{what} {key[0]}{key[1:]} is not on this rank")
        self.tensors[rank].remove(key)

    def _measure(self, rank: int) -> None:
        self.peak_params[rank] = max(self.peak_params[rank], len(self.resident[rank]))
        held = sum(1 for key in self.tensors[rank] if key[0] == "ckpt")
        held += len(self.posted_irecvs[rank])
        self.peak_ckpts[rank] = max(self.peak_ckpts[rank], held)

    def _compute(self, rank: int, index: int, ins: Instruction) -> None:
        s = self.schedule
        if ins in self.computed:
            self._fail(rank, index, ins, RULE_ONCE, "already computed")
        if not (0 <= ins.stage < s.forward_stages and 0 <= ins.mb < s.micro_batches):
            self._fail(rank, index, ins, RULE_ONCE, "stage or micro-batch out of range")
        self.computed.add(ins)
        if ins.op == Op.FORWARD:
            if s.forward_rank[ins.stage] != rank:
                self._fail(rank, index, ins, RULE_ASSIGNMENT,
                           f"forward stage {ins.stage} belongs to rank {s.forward_rank[ins.stage]}")
            needed = s.stage_pieces(ins.stage, -1)
            if ins.stage > 0:
                self._take(rank, index, ins, ("act", ins.stage - 1, -1, ins.mb), "input activation")
        else:
            piece = (ins.stage, ins.sub)
            if s.backward_rank.get(piece) != rank:
                self._fail(rank, index, ins, RULE_ASSIGNMENT,
                           f"backward stage {piece} belongs to rank {s.backward_rank.get(piece)}")
            needed = [piece]
        missing = [p for p in needed if p not in self.resident[rank]]
        if missing:
            self._fail(rank, index, ins, RULE_PARAMS, f"parameters of {missing} not prefetched")
        if ins.op == Op.FORWARD:
            if ins.stage + 1 < s.forward_stages:
                self.tensors[rank].add(("act", ins.stage, -1, ins.mb))
            for sub in range(s.backward_split):
                if (ins.stage, sub) != (0, 0):
                    self.tensors[rank].add(("ckpt", ins.stage, sub, ins.mb))
            return
        if piece != (0, 0):
            self._take(rank, index, ins, ("ckpt", *piece, ins.mb), "checkpoint")
        after = s.next_piece(piece)
        if after is not None:
            self._take(rank, index, ins, ("grad", *after, ins.mb), "incoming gradient")
        if s.previous_piece(piece) is not None:
            self.tensors[rank].add(("grad", *piece, ins.mb))
        self.backward_counts[rank][piece] += 1

    def local(self, rank: int, index: int, ins: Instruction) -> None:
        s = self.schedule
        op = ins.op
        if op in (Op.FORWARD, Op.BACKWARD):
            self._compute(rank, index, ins)
        elif op == Op.PREFETCH_PARAMS:
            pieces = s.stage_pieces(ins.stage, ins.sub)
            if self.resident[rank].intersection(pieces):
                self._fail(rank, index, ins, RULE_RESIDENCY, "parameters are already resident")
            self.resident[rank].update(pieces)
        elif op == Op.RELEASE_PARAMS:
            pieces = s.stage_pieces(ins.stage, ins.sub)
            if not set(pieces) <= self.resident[rank]:
                self._fail(rank, index, ins, RULE_RESIDENCY, "parameters are not resident")
            self.resident[rank].difference_update(pieces)
        elif op == Op.ISEND_CKPT:
            self._take(rank, index, ins, ins.tensor_key, "checkpoint")
        elif op == Op.IRECV_CKPT:
            self.posted_irecvs[rank].add(ins.tensor_key)
        elif op == Op.WAIT_CKPT:
            if ins.tensor_key not in self.posted_irecvs[rank]:
                self._fail(rank, index, ins, RULE_POSTED, "no IRECV_CKPT posted before the wait")
            if self.posted_isends[ins.tensor_key] != ins.peer:
                self._fail(rank, index, ins, RULE_INPUT, "checkpoint sent by another rank")
            self.posted_irecvs[rank].remove(ins.tensor_key)
            self.waited.add(ins.tensor_key)
            self.tensors[rank].add(ins.tensor_key)
        elif op == Op.OFFLOAD_GRAD:
            piece = (ins.stage, ins.sub)
            done = self.backward_counts[rank][piece]
            if s.backward_rank.get(piece) != rank or done != s.micro_batches:
                self._fail(rank, index, ins, RULE_GRADIENTS,
                           f"{done} of {s.micro_batches} micro-batches' backward done here")
            if piece in self.offloaded:
                self._fail(rank, index, ins, RULE_GRADIENTS, "offloaded twice")
            self.offloaded[piece] = rank
        elif op == Op.OPTIMIZER_START:
            piece = (ins.stage, ins.sub)
            if self.offloaded.get(piece) != rank:
                self._fail(rank, index, ins, RULE_OPTIMIZER, "gradients not offloaded on this rank")
            if piece in self.stepped:
                self._fail(rank, index, ins, RULE_OPTIMIZER, "optimizer started twice")
            if not (self.synced[rank] or self.post_step_mode[rank]):
                self._fail(rank, index, ins, RULE_OPTIMIZER,
                           "no OVERFLOW_SYNC before it and no POST_STEP_SYNC after")
            self.stepped[piece] = rank
        elif op == Op.OPTIMIZER_WAIT_ALL:
            self.waited_all[rank] = True
        elif op == Op.ROLLBACK_IF_OVERFLOW:
            if not self.post_synced[rank]:
                self._fail(rank, index, ins, RULE_OPTIMIZER, "rollback before POST_STEP_SYNC")
        self._measure(rank)

    def rendezvous(self, sender: int, send_index: int, receiver: int, recv_index: int) -> None:
        ins = self.schedule.programs[sender][send_index]
        self._take(sender, send_index, ins, ins.tensor_key, "sent tensor")
        self.tensors[receiver].add(ins.tensor_key)
        self._measure(receiver)

    def collective(self, op: Op, indices: list[int]) -> None:
        for rank, index in enumerate(indices):
            ins = self.schedule.programs[rank][index]
            if op == Op.OVERFLOW_SYNC:
                self.synced[rank] = True
            elif not self.waited_all[rank]:
                self._fail(rank, index, ins, RULE_OPTIMIZER,
                           "post-step sync before OPTIMIZER_WAIT_ALL")
            else:
                self.post_synced[rank] = True

    def finish(self) -> None:
        s = self.schedule
        for stage in range(s.forward_stages):
            for mb in range(s.micro_batches):
                expected = [(Instruction(Op.FORWARD, stage=stage, mb=mb), s.forward_rank[stage])]
                expected += [
                    (Instruction(Op.BACKWARD, stage=stage, sub=sub, mb=mb),
                     s.backward_rank[(stage, sub)])
                    for sub in range(s.backward_split)
                ]
                for ins, rank in expected:
                    if ins not in self.computed:
                        raise ScheduleError(rank, len(s.programs[rank]), None, RULE_ONCE,
                                            f"{ins} never runs")
        for piece in s.pieces():
            owner = s.backward_rank[piece]
            if piece not in self.stepped:
                raise ScheduleError(owner, len(s.programs[owner]), None, RULE_OPTIMIZER,
                                    f"backward stage {piece} never offloaded and stepped")
        for key, sender in self.posted_isends.items():
            if key not in self.waited:
                raise ScheduleError(sender, len(s.programs[sender]), None, RULE_MATCHED,
                                    f"ISEND_CKPT of {key[0]}{key[1:]} never received")
        for rank in range(s.ranks):
            end = len(s.programs[rank])
            if self.resident[rank]:
                raise ScheduleError(rank, end, None, RULE_RESIDENCY,
                                    f"parameters {sorted(self.resident[rank])} still resident")
            leftovers = sorted(self.tensors[rank] | self.posted_irecvs[rank])
            if leftovers:
                raise ScheduleError(rank, end, None, RULE_DANGLING,
                                    f"tensors {leftovers} produced or posted but never used")
            if self.post_step_mode[rank] and not self.post_synced[rank]:
                raise ScheduleError(rank, end, None, RULE_OPTIMIZER, "no POST_STEP_SYNC ran")


def validate(schedule: Schedule) -> ValidationReport:
    """Check every rule (module docstring); raise ScheduleError at the first violation."""
    checker = _Checker(schedule)
    checker.run()
    return ValidationReport(
        instructions=tuple(len(program) for program in schedule.programs),
        peak_params=tuple(checker.peak_params),
        peak_checkpoints=tuple(checker.peak_ckpts),
    )
