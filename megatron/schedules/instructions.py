"""The instruction vocabulary of pipeline schedules and the `Schedule` container.

A schedule is data: for every rank, the ordered list of instructions of one training
iteration. The validator, the simulator and the executor all read the same lists.
See docs/schedules.md ("Executor contract") for what each instruction does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

Piece = tuple[int, int]  # a backward stage (forward stage, sub-stage)


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


# The tensor role each communication op moves; the executor picks buffers by it.
_ROLE_OF = {
    Op.SEND_ACT: "act",
    Op.RECV_ACT: "act",
    Op.SEND_GRAD: "grad",
    Op.RECV_GRAD: "grad",
    Op.ISEND_CKPT: "ckpt",
    Op.IRECV_CKPT: "ckpt",
    Op.WAIT_CKPT: "ckpt",
}
BLOCKING_SENDS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
BLOCKING_RECVS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
COLLECTIVES = frozenset({Op.OVERFLOW_SYNC, Op.POST_STEP_SYNC})
COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD})
WHOLE_STAGE = -1  # `sub` of a PREFETCH/RELEASE that covers every piece of a forward stage


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
        object.__setattr__(self, "op", Op(self.op))
        expected = _ROLE_OF.get(self.op, "")
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
    backward_rank: dict[Piece, int]
    programs: tuple[tuple[Instruction, ...], ...]

    def pieces(self) -> list[Piece]:
        """All backward stages in model order."""
        return [(i, k) for i in range(self.forward_stages) for k in range(self.backward_split)]

    def owned_pieces(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces() if self.backward_rank[p] == rank]

    def stage_pieces(self, stage: int, sub: int) -> list[Piece]:
        """The pieces a PREFETCH/RELEASE of (stage, sub) covers."""
        if sub == WHOLE_STAGE:
            return [(stage, k) for k in range(self.backward_split)]
        return [(stage, sub)]

    def previous_piece(self, piece: Piece) -> Piece | None:
        """The backward stage that receives this one's input gradient (None for (0, 0))."""
        stage, sub = piece
        if sub > 0:
            return (stage, sub - 1)
        if stage > 0:
            return (stage - 1, self.backward_split - 1)
        return None

    def next_piece(self, piece: Piece) -> Piece | None:
        """The backward stage whose gradient this one consumes (None for the head's)."""
        stage, sub = piece
        if sub < self.backward_split - 1:
            return (stage, sub + 1)
        if stage < self.forward_stages - 1:
            return (stage + 1, 0)
        return None
