"""The instruction vocabulary of pipeline schedules and the `Schedule` container.

A schedule is data: for every rank, the ordered list of instructions of one training
iteration. The validator, the simulator and the executor all read the same lists.
See docs/schedules.md ("Executor contract") for what each instruction does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class BackwardStage(NamedTuple):
    """Backward stage (stage, sub): the sub-th of the `backward_split` contiguous parts of
    forward stage `stage`. The unit of ownership: one rank runs its backward and owns its
    parameters' segment, gradient buffer and optimizer state."""

    stage: int
    sub: int


class Op(str, Enum):
    PREFETCH_PARAMS = "PREFETCH_PARAMS"
    RELEASE_PARAMS = "RELEASE_PARAMS"
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ISEND_CKPT = "ISEND_CKPT"
    IRECV_CKPT = "IRECV_CKPT"
    WAIT_CKPT = "WAIT_CKPT"
    OFFLOAD_GRAD = "OFFLOAD_GRAD"
    OPTIMIZER_START = "OPTIMIZER_START"
    OPTIMIZER_WAIT_ALL = "OPTIMIZER_WAIT_ALL"
    OVERFLOW_SYNC = "OVERFLOW_SYNC"
    POST_STEP_SYNC = "POST_STEP_SYNC"
    ROLLBACK_IF_OVERFLOW = "ROLLBACK_IF_OVERFLOW"
    OPTIMIZER_START_SUBGROUPS = "OPTIMIZER_START_SUBGROUPS"
    READ_OPTIMIZER_STATES = "READ_OPTIMIZER_STATES"
    WRITE_OPTIMIZER_STATES = "WRITE_OPTIMIZER_STATES"


class Stepping(str, Enum):
    """How an instruction advances its rank under blocking semantics (the interpreter)."""

    LOCAL = "local"  # never waits on another rank
    SEND = "send"  # blocking send: completes together with the peer's matching receive
    RECV = "recv"  # blocking receive
    WAIT_POSTED = "wait-posted"  # waits until the peer has posted the matching ISEND
    COLLECTIVE = "collective"  # every rank must reach the same one


@dataclass(frozen=True)
class OpSpec:
    """What an instruction means, for the validator, the simulator and the executor alike.

    moves: the tensor it moves between ranks ("act", "grad", "ckpt") or "" for none.
    stepping: how it blocks (see Stepping).
    resource: the simulated resource it occupies ("compute", "h2d", "d2h", "network",
    "cpu-optimizer", "disk": the node's drive, "host": the rank's main thread, "none":
    bookkeeping only).
    action: what the executor does, in one line.
    handler: the name every consumer implements for it, as the method `_<handler>` (the
    validator's rule check, the simulator's cost, the executor's action).
    """

    moves: str
    stepping: Stepping
    resource: str
    action: str
    handler: str

    @property
    def method(self) -> str:
        return f"_{self.handler}"


OP_SPECS: dict[Op, OpSpec] = {
    Op.PREFETCH_PARAMS: OpSpec("", Stepping.LOCAL, "h2d",
                               "copy the backward stages' parameters from the node's "
                               "shared-memory store into a device parameter slot", "prefetch"),
    Op.RELEASE_PARAMS: OpSpec("", Stepping.LOCAL, "none",
                              "give the parameter slots back after their last use", "release"),
    Op.FORWARD: OpSpec("", Stepping.LOCAL, "compute",
                       "forward through the stage without autograd, keeping the activation "
                       "checkpoint at each backward stage's input", "forward"),
    Op.BACKWARD: OpSpec("", Stepping.LOCAL, "compute",
                        "recompute from the activation checkpoint, back-propagate, "
                        "accumulate parameter gradients", "backward"),
    Op.SEND_ACT: OpSpec("act", Stepping.SEND, "network", "blocking send of a stage's output", "send_activation"),
    Op.RECV_ACT: OpSpec("act", Stepping.RECV, "network", "blocking receive of a stage's input", "recv_activation"),
    Op.SEND_GRAD: OpSpec("grad", Stepping.SEND, "network",
                         "blocking send of a backward stage's input gradient", "send_gradient"),
    Op.RECV_GRAD: OpSpec("grad", Stepping.RECV, "network",
                         "blocking receive of the gradient a backward stage starts from", "recv_gradient"),
    Op.ISEND_CKPT: OpSpec("ckpt", Stepping.LOCAL, "network",
                          "post the asynchronous send of an activation checkpoint", "isend_act_ckpt"),
    Op.IRECV_CKPT: OpSpec("ckpt", Stepping.LOCAL, "network",
                          "post the asynchronous receive of an activation checkpoint", "irecv_act_ckpt"),
    Op.WAIT_CKPT: OpSpec("ckpt", Stepping.WAIT_POSTED, "network",
                         "wait for a posted checkpoint receive, right before its recompute", "wait_act_ckpt"),
    Op.OFFLOAD_GRAD: OpSpec("", Stepping.LOCAL, "d2h",
                            "copy a backward stage's accumulated gradients to host memory", "offload"),
    Op.OPTIMIZER_START: OpSpec("", Stepping.LOCAL, "cpu-optimizer",
                               "start the backward stage's CPU AdamW once its gradients are "
                               "home: speculative (checks itself) before the overflow "
                               "verdict, the deferred update after it", "optimizer_start"),
    Op.OPTIMIZER_WAIT_ALL: OpSpec("", Stepping.LOCAL, "host",
                                  "wait for every optimizer task this rank started", "optimizer_wait_all"),
    Op.OVERFLOW_SYNC: OpSpec("", Stepping.COLLECTIVE, "host",
                             "check every offloaded gradient (finite, sum of squares), then "
                             "all-reduce the overflow flags and the norm: the verdict", "overflow_sync"),
    Op.POST_STEP_SYNC: OpSpec("", Stepping.COLLECTIVE, "host",
                              "all-reduce the speculative steps' overflow flags and norm: "
                              "the verdict", "post_step_sync"),
    Op.ROLLBACK_IF_OVERFLOW: OpSpec("", Stepping.LOCAL, "cpu-optimizer",
                                    "undo the speculative steps when the verdict says "
                                    "overflow, re-clip them in one pass when the clip factor "
                                    "differs; per stage, behind the next forward wave", "rollback_if_overflow"),
    Op.OPTIMIZER_START_SUBGROUPS: OpSpec("", Stepping.LOCAL, "cpu-optimizer",
                                         "OPTIMIZER_START for a stage whose update would be "
                                         "exposed: every k-th subgroup is updated on the "
                                         "device (copies in and out on the optimizer's own "
                                         "streams) while the CPU updates the others",
                                         "optimizer_start_subgroups"),
    Op.READ_OPTIMIZER_STATES: OpSpec("", Stepping.LOCAL, "disk",
                                     "states on NVMe: read the backward stage's committed "
                                     "optimizer state into a host window buffer (waiting for "
                                     "a free one off the main thread); its step waits for it",
                                     "read_optimizer_states"),
    Op.WRITE_OPTIMIZER_STATES: OpSpec("", Stepping.LOCAL, "disk",
                                      "states on NVMe: once the stage's step is over, write "
                                      "its result as the staged version (the verdict commits "
                                      "or drops it) and give the window buffer back",
                                      "write_optimizer_states"),
}
# The ops that start a backward stage's optimizer step (one per owned stage and iteration).
OPTIMIZER_STARTS = frozenset({Op.OPTIMIZER_START, Op.OPTIMIZER_START_SUBGROUPS})
# The disk traffic of optimizer states kept on NVMe (one of each per owned stage).
STATE_IO = frozenset({Op.READ_OPTIMIZER_STATES, Op.WRITE_OPTIMIZER_STATES})

BLOCKING_SENDS = frozenset(op for op, spec in OP_SPECS.items() if spec.stepping == Stepping.SEND)
BLOCKING_RECVS = frozenset(op for op, spec in OP_SPECS.items() if spec.stepping == Stepping.RECV)
BLOCKING_TRANSFERS = BLOCKING_SENDS | BLOCKING_RECVS
# Everything that posts a send or a receive between two ranks (NCCL matches them in order).
POSTED_SENDS = BLOCKING_SENDS | {Op.ISEND_CKPT}
POSTED_RECEIVES = BLOCKING_RECVS | {Op.IRECV_CKPT}
COLLECTIVES = frozenset(op for op, spec in OP_SPECS.items()
                        if spec.stepping == Stepping.COLLECTIVE)
COMPUTE = frozenset(op for op, spec in OP_SPECS.items() if spec.resource == "compute")
WHOLE_STAGE = -1  # `sub` of a PREFETCH/RELEASE that covers every backward stage of a stage


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's program. Unused integer fields are -1.

    stage: forward stage; sub: backward sub-stage (or WHOLE_STAGE for parameters of a
    whole forward stage); mb: micro-batch; peer: the other rank of a communication;
    role: the tensor a communication moves ("act", "grad", "ckpt"), derived from op.
    """

    op: Op
    stage: int = -1
    sub: int = -1
    mb: int = -1
    peer: int = -1
    role: str = field(default="")

    def __post_init__(self) -> None:
        if type(self.op) is not Op:  # a string from a schedule file; programs build millions
            object.__setattr__(self, "op", Op(self.op))
        expected = OP_SPECS[self.op].moves
        if self.role and self.role != expected:
            raise ValueError(f"role {self.role!r} does not match op {self.op.value}")
        object.__setattr__(self, "role", expected)

    @property
    def tensor_key(self) -> tuple:
        """Identity of the tensor a communication moves, equal on both sides."""
        return (self.role, self.stage, self.sub, self.mb)

    def __str__(self) -> str:
        parts = [self.op.value]
        for name in ("stage", "sub", "mb", "peer"):
            value = getattr(self, name)
            if value != -1 or (name == "sub" and self.op in _PARAM_OPS):
                parts.append(f"{name}={value}")
        return " ".join(parts)


_PARAM_OPS = frozenset({Op.PREFETCH_PARAMS, Op.RELEASE_PARAMS})


def transfer_batches(program: Sequence[Instruction]) -> list[range]:
    """The positions of each batch of blocking transfers in `program`: a run of consecutive
    SEND/RECV_ACT and SEND/RECV_GRAD with one peer. A batch is posted at once, in program
    order (torch.distributed.batch_isend_irecv: one NCCL group), and the rank goes on when
    all of it is done; the interpreter steps it the same way. Checkpoint transfers are not
    batched: each is waited on alone, right before its recompute."""
    batches: list[range] = []
    start = None
    for index, ins in enumerate((*program, None)):
        if start is not None and (ins is None or ins.op not in BLOCKING_TRANSFERS
                                  or ins.peer != program[start].peer):
            batches.append(range(start, index))
            start = None
        if start is None and ins is not None and ins.op in BLOCKING_TRANSFERS:
            start = index
    return batches


@dataclass(frozen=True)
class Schedule:
    """One iteration's programs for every rank, with the configuration they assume.

    forward_rank[i] runs forward stage i; backward_rank[(i, k)] runs backward stage (i, k)
    and owns its parameters, gradients and optimizer state.
    """

    name: str
    ranks: int
    forward_stages: int
    backward_split: int
    micro_batches: int
    partition: tuple[int, ...]
    forward_rank: tuple[int, ...]
    backward_rank: dict[BackwardStage, int]
    programs: tuple[tuple[Instruction, ...], ...]
    # An evaluation program: forwards and their transfers only, no activation checkpoints
    # kept, no backward, no optimizer phase (lowering.forward_only_schedule).
    forward_only: bool = False

    @property
    def states_on_disk(self) -> bool:
        """Whether the programs read and write optimizer states on NVMe (STATE_IO)."""
        return any(ins.op in STATE_IO for program in self.programs for ins in program)

    def backward_stages(self) -> list[BackwardStage]:
        """All backward stages in model order."""
        return [BackwardStage(i, k) for i in range(self.forward_stages)
                for k in range(self.backward_split)]

    def owned_by(self, rank: int) -> list[BackwardStage]:
        """The backward stages `rank` runs and owns, in model order."""
        return [b for b in self.backward_stages() if self.backward_rank[b] == rank]

    def params_of(self, stage: int, sub: int) -> list[BackwardStage]:
        """The backward stages whose parameters a PREFETCH/RELEASE of (stage, sub) covers."""
        if sub == WHOLE_STAGE:
            return [BackwardStage(stage, k) for k in range(self.backward_split)]
        return [BackwardStage(stage, sub)]

    def previous_backward_stage(self, b: BackwardStage) -> BackwardStage | None:
        """The backward stage that receives this one's input gradient (None for (0, 0))."""
        stage, sub = b
        if sub > 0:
            return BackwardStage(stage, sub - 1)
        if stage > 0:
            return BackwardStage(stage - 1, self.backward_split - 1)
        return None

    def next_backward_stage(self, b: BackwardStage) -> BackwardStage | None:
        """The backward stage whose gradient this one consumes (None for the head's)."""
        stage, sub = b
        if sub < self.backward_split - 1:
            return BackwardStage(stage, sub + 1)
        if stage < self.forward_stages - 1:
            return BackwardStage(stage + 1, 0)
        return None

    @property
    def head(self) -> BackwardStage:
        """The backward stage that holds the head (final norm, output layer, loss)."""
        return BackwardStage(self.forward_stages - 1, self.backward_split - 1)

    def shape(self) -> dict:
        """What a run must agree with: everything but the programs."""
        return {"name": self.name, "ranks": self.ranks, "forward_stages": self.forward_stages,
                "backward_split": self.backward_split, "micro_batches": self.micro_batches,
                "partition": self.partition}
