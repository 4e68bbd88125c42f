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
  prefetched parameter released by the end;
- optimizer states on NVMe (a program with READ/WRITE_OPTIMIZER_STATES): each owned
  stage's state read once before its step and written once after it, on its owner; the
  report gives the window (stages read and not yet written at once);
- for every ordered pair of ranks, the sender posts its sends (blocking or not) in the
  order the receiver posts the matching receives: NCCL ignores tags and matches by that
  order, so any other order would swap tensors of the same shape without an error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .instructions import (
    OP_SPECS,
    POSTED_RECEIVES,
    POSTED_SENDS,
    STATE_IO,
    BackwardStage,
    Instruction,
    Op,
    Schedule,
)
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
RULE_PAIR_ORDER = "sends and receives between two ranks posted in the same order"
RULE_FORWARD_ONLY = "a forward-only program has no backward, checkpoint or optimizer work"
RULE_STATE_IO = "optimizer states on disk read before their step and written after it"


@dataclass(frozen=True)
class ValidationReport:
    """Resident bounds per rank: parameters (in backward stages) and checkpoints.

    peak_params[r] counts backward stages' parameters resident at once on rank r (a whole
    forward stage counts `backward_split`); peak_checkpoints[r] counts activation
    checkpoints held (kept for a local backward, or received/being received);
    checkpoints_in_backward[r][b] the most held while a backward of stage b recomputes
    (its own taken: autograd then keeps it as the stage's input), so that a memory model
    can add what that recompute saves at the moment it saves it. The `_sent` variants
    count, besides, every checkpoint the rank has sent so far in the iteration: what a
    sender holds when its sends are known complete only at the iteration's end (gloo).
    """

    instructions: tuple[int, ...]
    peak_params: tuple[int, ...]
    peak_checkpoints: tuple[int, ...]
    peak_gradients: tuple[int, ...] = ()  # device gradient buffers in use at once, per rank
    # Optimizer states on NVMe: backward stages' states read and not yet written at once,
    # per rank (the host window); () when the states stay in host memory.
    peak_optimizer_states: tuple[int, ...] = ()
    checkpoints_in_backward: tuple[dict[BackwardStage, int], ...] = ()
    peak_checkpoints_sent: tuple[int, ...] = ()
    checkpoints_in_backward_sent: tuple[dict[BackwardStage, int], ...] = ()
    # activations and gradients held at the checkpoints' peak (the most, where it is reached
    # more than once), without and with the sent checkpoints
    messages_at_peak: tuple[int, ...] = ()
    messages_at_peak_sent: tuple[int, ...] = ()


class _StateWindow:
    """RULE_STATE_IO's part of the check (optimizer states on NVMe): which backward stages'
    states have been read and written, and the most each rank holds read at once (its host
    window). Each method records an instruction and says what is wrong with it, if anything."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.read_by: dict[BackwardStage, int] = {}
        self.written: set[BackwardStage] = set()
        self.peak = [0 for _ in range(schedule.ranks)]

    def read(self, rank: int, b: BackwardStage) -> str | None:
        if self.schedule.backward_rank.get(b) != rank:
            return "the stage is not owned by this rank"
        if b in self.read_by:
            return "read twice"
        self.read_by[b] = rank
        held = sum(1 for s, r in self.read_by.items() if r == rank and s not in self.written)
        self.peak[rank] = max(self.peak[rank], held)
        return None

    def step(self, b: BackwardStage) -> str | None:
        if b not in self.read_by or b in self.written:
            return "no READ_OPTIMIZER_STATES of the stage before it"
        return None

    def write(self, b: BackwardStage, stepped_here: bool) -> str | None:
        if not stepped_here:
            return "written before its OPTIMIZER_START"
        if b in self.written:
            return "written twice"
        self.written.add(b)
        return None


class _OptimizerRules:
    """RULE_OPTIMIZER's and RULE_STATE_IO's part of the check: each owned stage's step after
    its offload and an overflow check (an OVERFLOW_SYNC before it, or OPTIMIZER_WAIT_ALL,
    POST_STEP_SYNC and ROLLBACK_IF_OVERFLOW after it), and its states on NVMe read before it
    and written after it. The handlers are the checker's, for the optimizer's ops."""

    def __init__(self, schedule: Schedule) -> None:
        ranks = range(schedule.ranks)
        self.offloaded: dict = {}  # backward stage -> the rank that offloaded it
        self.stepped: dict = {}
        self.synced = [False for _ in ranks]
        self.waited_all = [False for _ in ranks]
        self.post_synced = [False for _ in ranks]
        self.rolled_back = [False for _ in ranks]
        self.post_step_mode = [
            any(ins.op == Op.POST_STEP_SYNC for ins in program) for program in schedule.programs
        ]
        self.states_on_disk = schedule.states_on_disk
        self.states = _StateWindow(schedule)

    def _optimizer_start(self, rank: int, index: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        if self.offloaded.get(b) != rank:
            raise ScheduleError(rank, index, ins, RULE_OPTIMIZER,
                                "gradients not offloaded on this rank")
        if b in self.stepped:
            raise ScheduleError(rank, index, ins, RULE_OPTIMIZER, "optimizer started twice")
        if not (self.synced[rank] or self.post_step_mode[rank]):
            raise ScheduleError(rank, index, ins, RULE_OPTIMIZER,
                                "no OVERFLOW_SYNC before it and no POST_STEP_SYNC after")
        problem = self.states.step(b) if self.states_on_disk else None
        if problem:
            raise ScheduleError(rank, index, ins, RULE_STATE_IO, problem)
        self.stepped[b] = rank

    def _read_optimizer_states(self, rank: int, index: int, ins: Instruction) -> None:
        problem = self.states.read(rank, BackwardStage(ins.stage, ins.sub))
        if problem:
            raise ScheduleError(rank, index, ins, RULE_STATE_IO, problem)

    def _write_optimizer_states(self, rank: int, index: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        problem = self.states.write(b, self.stepped.get(b) == rank)
        if problem:
            raise ScheduleError(rank, index, ins, RULE_STATE_IO, problem)

    def _optimizer_start_subgroups(self, rank: int, index: int, ins: Instruction) -> None:
        """OPTIMIZER_START's rules: where the update runs does not change when it may."""
        self._optimizer_start(rank, index, ins)

    def _optimizer_wait_all(self, rank: int, index: int, ins: Instruction) -> None:
        self.waited_all[rank] = True

    def _rollback_if_overflow(self, rank: int, index: int, ins: Instruction) -> None:
        if not self.post_synced[rank]:
            raise ScheduleError(rank, index, ins, RULE_OPTIMIZER,
                                "rollback before POST_STEP_SYNC")
        self.rolled_back[rank] = True

    def _overflow_sync(self, rank: int, index: int, ins: Instruction) -> None:
        self.synced[rank] = True

    def _post_step_sync(self, rank: int, index: int, ins: Instruction) -> None:
        if not self.waited_all[rank]:
            raise ScheduleError(rank, index, ins, RULE_OPTIMIZER,
                                "post-step sync before OPTIMIZER_WAIT_ALL")
        self.post_synced[rank] = True

    def finish_stage(self, b: BackwardStage, owner: int, end: int) -> None:
        """At the end: `b` (owned by `owner`, whose program has `end` instructions) was
        stepped, and its states written when they live on NVMe."""
        if b not in self.stepped:
            raise ScheduleError(owner, end, None, RULE_OPTIMIZER,
                                f"backward stage {b} never offloaded and stepped")
        if self.states_on_disk and b not in self.states.written:
            raise ScheduleError(owner, end, None, RULE_STATE_IO,
                                f"backward stage {b}'s optimizer states never written")

    def finish_rank(self, rank: int, end: int) -> None:
        """At the end of `rank`'s program: speculative steps were synced and corrected."""
        if self.post_step_mode[rank] and not self.post_synced[rank]:
            raise ScheduleError(rank, end, None, RULE_OPTIMIZER, "no POST_STEP_SYNC ran")
        if self.post_step_mode[rank] and not self.rolled_back[rank]:
            raise ScheduleError(rank, end, None, RULE_OPTIMIZER,
                                "speculative steps without a ROLLBACK_IF_OVERFLOW after "
                                "the POST_STEP_SYNC")


class _Checker(Interpreter):
    """Every rule but the optimizer's, which `_OptimizerRules` checks (its ops' handlers)."""

    handler_parts = (_OptimizerRules,)

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        ranks = range(schedule.ranks)
        self.resident = [set() for _ in ranks]
        self.tensors = [set() for _ in ranks]  # available tensor keys per rank
        self.held_ckpts = [0 for _ in ranks]  # the "ckpt" keys among them
        self.posted_irecvs = [set() for _ in ranks]
        self.peak_params = [0 for _ in ranks]
        self.ckpts_in_backward: list[dict[BackwardStage, int]] = [{} for _ in ranks]
        self.sent_ckpts = [0 for _ in ranks]  # ISEND_CKPTs posted so far
        self.ckpts_in_backward_sent: list[dict[BackwardStage, int]] = [{} for _ in ranks]
        # (checkpoints, activation and gradient messages) at the checkpoints' peak: the
        # peak itself, and the most messages where it is reached more than once
        self.ckpt_peak_moment = [(0, 0) for _ in ranks]
        self.ckpt_peak_moment_sent = [(0, 0) for _ in ranks]
        self.live_gradients = [0 for _ in ranks]
        self.peak_gradients = [0 for _ in ranks]
        self.computed: set[Instruction] = set()
        self.backward_counts = [Counter() for _ in ranks]
        self.waited: set[tuple] = set()
        self.optimizer = _OptimizerRules(schedule)

    def _handler(self, op: Op):
        """The checker's own rule for `op`, or the optimizer rules' for the optimizer's ops."""
        method = OP_SPECS[op].method
        return getattr(self, method, None) or getattr(self.optimizer, method)

    def _fail(self, rank: int, index: int, ins: Instruction, rule: str, detail: str):
        raise ScheduleError(rank, index, ins, rule, detail)

    def _take(self, rank: int, index: int, ins: Instruction, key: tuple, what: str) -> None:
        if key not in self.tensors[rank]:
            self._fail(rank, index, ins, RULE_INPUT, f"{what} {key[0]}{key[1:]} is not on this rank")
        self.tensors[rank].remove(key)
        self.held_ckpts[rank] -= key[0] == "ckpt"

    def _hold(self, rank: int, key: tuple) -> None:
        self.tensors[rank].add(key)
        self.held_ckpts[rank] += key[0] == "ckpt"

    def _checkpoints_held(self, rank: int) -> int:
        """Checkpoints kept for a local backward, or received or being received."""
        return self.held_ckpts[rank] + len(self.posted_irecvs[rank])

    def _measure(self, rank: int) -> None:
        self.peak_params[rank] = max(self.peak_params[rank], len(self.resident[rank]))
        held = self._checkpoints_held(rank)
        messages = len(self.tensors[rank]) - self.held_ckpts[rank]  # activations, gradients
        for moments, count in ((self.ckpt_peak_moment, held),
                               (self.ckpt_peak_moment_sent, held + self.sent_ckpts[rank])):
            moments[rank] = max(moments[rank], (count, messages))

    def _compute(self, rank: int, index: int, ins: Instruction) -> None:
        s = self.schedule
        b = BackwardStage(ins.stage, ins.sub)
        if ins in self.computed:
            self._fail(rank, index, ins, RULE_ONCE, "already computed")
        if not (0 <= ins.stage < s.forward_stages and 0 <= ins.mb < s.micro_batches):
            self._fail(rank, index, ins, RULE_ONCE, "stage or micro-batch out of range")
        self.computed.add(ins)
        if ins.op == Op.FORWARD:
            if s.forward_rank[ins.stage] != rank:
                self._fail(rank, index, ins, RULE_ASSIGNMENT,
                           f"forward stage {ins.stage} belongs to rank {s.forward_rank[ins.stage]}")
            needed = s.params_of(ins.stage, -1)
            if ins.stage > 0:
                self._take(rank, index, ins, ("act", ins.stage - 1, -1, ins.mb), "input activation")
        else:
            if s.forward_only:
                self._fail(rank, index, ins, RULE_FORWARD_ONLY, "a backward")
            if s.backward_rank.get(b) != rank:
                self._fail(rank, index, ins, RULE_ASSIGNMENT,
                           f"backward stage {b} belongs to rank {s.backward_rank.get(b)}")
            needed = [b]
        missing = [p for p in needed if p not in self.resident[rank]]
        if missing:
            self._fail(rank, index, ins, RULE_PARAMS, f"parameters of {missing} not prefetched")
        if ins.op == Op.FORWARD:
            if ins.stage + 1 < s.forward_stages:
                self._hold(rank, ("act", ins.stage, -1, ins.mb))
            for sub in range(0 if s.forward_only else s.backward_split):
                if (ins.stage, sub) != (0, 0):
                    self._hold(rank, ("ckpt", ins.stage, sub, ins.mb))
            return
        if b != (0, 0):
            self._take(rank, index, ins, ("ckpt", *b, ins.mb), "checkpoint")
        held = self._checkpoints_held(rank)
        for books, count in ((self.ckpts_in_backward, held),
                             (self.ckpts_in_backward_sent, held + self.sent_ckpts[rank])):
            books[rank][b] = max(books[rank].get(b, 0), count)
        after = s.next_backward_stage(b)
        if after is not None:
            self._take(rank, index, ins, ("grad", *after, ins.mb), "incoming gradient")
        if s.previous_backward_stage(b) is not None:
            self._hold(rank, ("grad", *b, ins.mb))
        if self.backward_counts[rank][b] == 0:
            self.live_gradients[rank] += 1
            self.peak_gradients[rank] = max(self.peak_gradients[rank], self.live_gradients[rank])
        self.backward_counts[rank][b] += 1

    def local(self, rank: int, index: int, ins: Instruction) -> None:
        if self.schedule.forward_only and ins.op in _TRAINING_ONLY:
            self._fail(rank, index, ins, RULE_FORWARD_ONLY, f"{ins.op.value} in it")
        self._handler(ins.op)(rank, index, ins)
        self._measure(rank)

    _forward = _backward = _compute

    def _prefetch(self, rank: int, index: int, ins: Instruction) -> None:
        covered = self.schedule.params_of(ins.stage, ins.sub)
        if self.resident[rank].intersection(covered):
            self._fail(rank, index, ins, RULE_RESIDENCY, "parameters are already resident")
        self.resident[rank].update(covered)

    def _release(self, rank: int, index: int, ins: Instruction) -> None:
        covered = self.schedule.params_of(ins.stage, ins.sub)
        if not set(covered) <= self.resident[rank]:
            self._fail(rank, index, ins, RULE_RESIDENCY, "parameters are not resident")
        self.resident[rank].difference_update(covered)

    def _isend_act_ckpt(self, rank: int, index: int, ins: Instruction) -> None:
        self._take(rank, index, ins, ins.tensor_key, "checkpoint")
        self.sent_ckpts[rank] += 1

    def _irecv_act_ckpt(self, rank: int, index: int, ins: Instruction) -> None:
        self.posted_irecvs[rank].add(ins.tensor_key)

    def _wait_act_ckpt(self, rank: int, index: int, ins: Instruction) -> None:
        if ins.tensor_key not in self.posted_irecvs[rank]:
            self._fail(rank, index, ins, RULE_POSTED, "no IRECV_CKPT posted before the wait")
        if self.posted_isends[ins.tensor_key] != ins.peer:
            self._fail(rank, index, ins, RULE_INPUT, "checkpoint sent by another rank")
        self.posted_irecvs[rank].remove(ins.tensor_key)
        self.waited.add(ins.tensor_key)
        self._hold(rank, ins.tensor_key)

    def _offload(self, rank: int, index: int, ins: Instruction) -> None:
        s = self.schedule
        b = BackwardStage(ins.stage, ins.sub)
        done = self.backward_counts[rank][b]
        if s.backward_rank.get(b) != rank or done != s.micro_batches:
            self._fail(rank, index, ins, RULE_GRADIENTS,
                       f"{done} of {s.micro_batches} micro-batches' backward done here")
        if b in self.optimizer.offloaded:
            self._fail(rank, index, ins, RULE_GRADIENTS, "offloaded twice")
        self.optimizer.offloaded[b] = rank
        self.live_gradients[rank] -= 1

    def rendezvous(self, sender: int, send_index: int, receiver: int, recv_index: int) -> None:
        getattr(self, OP_SPECS[self.schedule.programs[sender][send_index].op].method)(
            sender, send_index, receiver)

    def _transfer(self, sender: int, send_index: int, receiver: int) -> None:
        ins = self.schedule.programs[sender][send_index]
        self._take(sender, send_index, ins, ins.tensor_key, "sent tensor")
        self._hold(receiver, ins.tensor_key)
        self._measure(receiver)

    # A receive is checked together with its send, in the rendezvous.
    _send_activation = _send_gradient = _recv_activation = _recv_gradient = _transfer

    def collective(self, op: Op, indices: list[int]) -> None:
        if self.schedule.forward_only:
            self._fail(0, indices[0], self.schedule.programs[0][indices[0]], RULE_FORWARD_ONLY,
                       f"{op.value} in it")
        for rank, index in enumerate(indices):
            self._handler(op)(rank, index, self.schedule.programs[rank][index])

    def finish(self) -> None:
        s = self.schedule
        for stage in range(s.forward_stages):
            for mb in range(s.micro_batches):
                expected = [(Instruction(Op.FORWARD, stage=stage, mb=mb), s.forward_rank[stage])]
                expected += [
                    (Instruction(Op.BACKWARD, stage=stage, sub=sub, mb=mb),
                     s.backward_rank[(stage, sub)])
                    for sub in range(0 if s.forward_only else s.backward_split)
                ]
                for ins, rank in expected:
                    if ins not in self.computed:
                        raise ScheduleError(rank, len(s.programs[rank]), None, RULE_ONCE,
                                            f"{ins} never runs")
        for b in [] if s.forward_only else s.backward_stages():
            owner = s.backward_rank[b]
            self.optimizer.finish_stage(b, owner, len(s.programs[owner]))
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
            self.optimizer.finish_rank(rank, end)


# Ops a forward-only program must not hold (its transfers are checked by their tensors).
_TRAINING_ONLY = frozenset({Op.BACKWARD, Op.ISEND_CKPT, Op.IRECV_CKPT, Op.WAIT_CKPT,
                            Op.OFFLOAD_GRAD, Op.OPTIMIZER_START, Op.OPTIMIZER_WAIT_ALL,
                            Op.OVERFLOW_SYNC, Op.POST_STEP_SYNC, Op.ROLLBACK_IF_OVERFLOW,
                            *STATE_IO})


def _by_peer(program: tuple[Instruction, ...], ops: frozenset) -> dict[int, list]:
    """{peer: [(index, instruction), ...]} of the program's `ops`, in program order."""
    by_peer: dict[int, list] = {}
    for index, ins in enumerate(program):
        if ins.op in ops:
            by_peer.setdefault(ins.peer, []).append((index, ins))
    return by_peer


def check_pair_order(schedule: Schedule) -> None:
    """RULE_PAIR_ORDER: the k-th send from rank a to rank b moves the tensor that b's k-th
    receive from a expects (ISEND/IRECV_CKPT included)."""
    sends = [_by_peer(program, POSTED_SENDS) for program in schedule.programs]
    for receiver, program in enumerate(schedule.programs):
        for sender, expected in sorted(_by_peer(program, POSTED_RECEIVES).items()):
            if not 0 <= sender < schedule.ranks:
                continue  # reported by the matching rule
            sent = sends[sender].get(receiver, [])
            for k, ((index, ins), (send_index, send)) in enumerate(zip(expected, sent)):
                if ins.tensor_key != send.tensor_key:
                    raise ScheduleError(
                        receiver, index, ins, RULE_PAIR_ORDER,
                        f"it is receive #{k} from rank {sender}, whose send #{k} to this rank "
                        f"is #{send_index} ({send}): NCCL would match the two")


def validate(schedule: Schedule) -> ValidationReport:
    """Check every rule (module docstring); raise ScheduleError at the first violation."""
    checker = _Checker(schedule)
    checker.run()
    check_pair_order(schedule)  # every send is matched by now: compare the orders
    return ValidationReport(
        instructions=tuple(len(program) for program in schedule.programs),
        peak_params=tuple(checker.peak_params),
        peak_checkpoints=tuple(c for c, _ in checker.ckpt_peak_moment),
        checkpoints_in_backward=tuple(checker.ckpts_in_backward),
        peak_checkpoints_sent=tuple(c for c, _ in checker.ckpt_peak_moment_sent),
        checkpoints_in_backward_sent=tuple(checker.ckpts_in_backward_sent),
        messages_at_peak=tuple(m for _, m in checker.ckpt_peak_moment),
        messages_at_peak_sent=tuple(m for _, m in checker.ckpt_peak_moment_sent),
        peak_gradients=tuple(checker.peak_gradients),
        peak_optimizer_states=(tuple(checker.optimizer.states.peak)
                               if checker.optimizer.states_on_disk else ()),
    )
