"""Point-to-point communication of activations, gradients and activation checkpoints.

Activations and gradients go in batches: the consecutive blocking transfers a rank's
program has with one peer (instructions.transfer_batches) are posted together as one
`batch_isend_irecv` (an NCCL group, as torch.distributed.pipelining posts a step's
transfers) and waited for together, so a send and a receive crossing between two ranks
in one step meet. Activation checkpoints go alone with isend/irecv, posted at the same
step on both sides and waited on only before the recompute that needs them (S section 4).
Under NCCL a batch runs on the group's communicator (whose first use every rank joins:
each reaches its first batch without waiting on another), a lone checkpoint transfer on
the two ranks' own; gloo has no groups and posts a batch's isend/irecv one by one.

Matching is by posting order only, as NCCL does it (NCCL ignores tags): every message
between two ranks carries the same tag, so gloo, too, pairs the k-th send with the k-th
receive. The programs post each pair's transfers in one order on both sides (the
validator checks it). With `checked`, each tensor is preceded by a 4-integer header
naming it (role, stage, sub, micro-batch) and the receiver fails, naming what arrived
instead, when it is not the tensor its instruction expects: a testing aid that costs one
host synchronisation per message.

With `staged` (CUDA ranks on gloo: --share-gpu, several ranks on one GPU), gloo moves no
device tensor between ranks, so each transfer goes through a page-locked host copy: the
sender copies the tensor out before posting, the receiver copies it in when it waits. The
order of posting is unchanged; each copy is a host synchronisation (a test mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron.schedules.instructions import Instruction

TAG = 0  # one tag for everything: matching by order, as under NCCL
_ROLE_CODES = {"act": 0, "grad": 1, "ckpt": 2}
_ROLES = {code: role for role, code in _ROLE_CODES.items()}
# Page-locked where there is a GPU; a CPU-only torch has no pinned allocator (the staged
# path then runs on the CPU device layer with plain host copies, for its tests).
_PINNABLE = torch.cuda.is_available()


@dataclass(frozen=True)
class MessageShape:
    shape: tuple[int, ...]
    dtype: torch.dtype


class WrongMessageError(RuntimeError):
    """A received tensor is not the one the receiving instruction expects."""


def _identity(instr: Instruction) -> tuple[int, int, int, int]:
    return (_ROLE_CODES[instr.role], instr.stage, instr.sub, instr.mb)


def _describe(identity: tuple[int, ...]) -> str:
    role, stage, sub, mb = identity
    return f"{_ROLES.get(role, f'role {role}')} stage={stage} sub={sub} mb={mb}"


class Waitable(Protocol):
    def wait(self) -> bool: ...

    def is_completed(self) -> bool: ...


class _StagedWork:
    """A receive into a host copy: wait() waits for it, then fills the device buffer."""

    def __init__(self, work: Waitable, host: torch.Tensor, device_buffer: torch.Tensor) -> None:
        self._work, self._host, self._buffer = work, host, device_buffer

    def wait(self) -> bool:
        self._work.wait()
        self._buffer.copy_(self._host)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _CheckedWork:
    """A header and its tensor in flight: wait() waits for both, then checks. It holds the
    tensors so that they live until the transfer is done."""

    def __init__(self, works: list[dist.Work], check: Callable[[], None],
                 tensors: tuple[torch.Tensor, ...]) -> None:
        self._works, self._check, self._tensors = works, check, tensors

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._check()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class PointToPoint:
    """Sends and receives [s, b, h] tensors between pipeline ranks."""

    def __init__(self, shape: MessageShape, device: torch.device, rank: int,
                 checked: bool = False, peers: list[int] | None = None,
                 staged: bool = False) -> None:
        """`peers[r]`: the global rank of pipeline rank r (None: the same); `staged`:
        transfers through page-locked host copies (a CUDA device on gloo)."""
        self.shape = shape
        self.staged = staged
        self.peers = peers
        self.device = device
        self.rank = rank
        self.checked = checked
        self._headers: dict[tuple, torch.Tensor] = {}

    def _global(self, peer: int) -> int:
        return peer if self.peers is None else self.peers[peer]

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape.shape, dtype=self.shape.dtype, device=self.device)

    def _header(self, instr: Instruction) -> torch.Tensor:
        return torch.tensor(_identity(instr), dtype=torch.int64, device=self.device)

    def _header_buffer(self, instr: Instruction) -> torch.Tensor:
        key = (instr.op, instr.tensor_key)
        if key not in self._headers:
            self._headers[key] = torch.empty(4, dtype=torch.int64, device=self.device)
        return self._headers[key]

    def _verify(self, instr: Instruction, header: torch.Tensor) -> None:
        arrived = tuple(header.tolist())  # a host sync: checked mode only
        if arrived != _identity(instr):
            raise WrongMessageError(
                f"rank {self.rank}, {instr}: expected {_describe(_identity(instr))} from rank "
                f"{instr.peer}, but {_describe(arrived)} arrived (sends and receives between "
                "the two ranks are posted in different orders)")

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """What goes on the wire: the tensor, or its page-locked host copy when staged
        (complete before it is posted: a blocking copy)."""
        tensor = tensor.contiguous()
        if not self.staged:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=_PINNABLE)
        host.copy_(tensor)
        return host

    def _post_irecv(self, buffer: torch.Tensor, src: int) -> Waitable:
        if not self.staged:
            return dist.irecv(buffer, src=src, tag=TAG)
        host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=_PINNABLE)
        return _StagedWork(dist.irecv(host, src=src, tag=TAG), host, buffer)

    def exchange(self, batch: Sequence[tuple[Instruction, torch.Tensor | None]]
                 ) -> list[torch.Tensor]:
        """Post one batch of blocking transfers with one peer (instructions.transfer_batches:
        a send with its tensor, a receive with None) in program order as one
        `batch_isend_irecv` (an NCCL group), and wait for all of it. Returns the received
        tensors in order."""
        ops: list[dist.P2POp] = []
        arrivals: list[tuple[Instruction, torch.Tensor, torch.Tensor | None]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host, device): staged only
        for instr, tensor in batch:
            peer = self._global(instr.peer)
            if tensor is not None:
                if self.checked:
                    ops.append(dist.P2POp(dist.isend, self._outgoing(self._header(instr)),
                                          peer, tag=TAG))
                ops.append(dist.P2POp(dist.isend, self._outgoing(tensor), peer, tag=TAG))
                continue
            header = self._header_buffer(instr) if self.checked else None
            buffer = self.empty()
            for target in (header, buffer):
                if target is not None:
                    ops.append(dist.P2POp(dist.irecv, self._incoming(target, copies), peer,
                                          tag=TAG))
            arrivals.append((instr, buffer, header))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for host, device_buffer in copies:
            device_buffer.copy_(host)
        for instr, _, header in arrivals:
            if header is not None:
                self._verify(instr, header)
        return [buffer for _, buffer, _ in arrivals]

    def _incoming(self, buffer: torch.Tensor,
                  copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Where a receive lands: `buffer`, or when staged a page-locked host copy, noted in
        `copies` to fill `buffer` from once the batch is done."""
        if not self.staged:
            return buffer
        host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=_PINNABLE)
        copies.append((host, buffer))
        return host

    def isend(self, instr: Instruction, tensor: torch.Tensor) -> Waitable:
        tensor = self._outgoing(tensor)
        if not self.checked:
            work = dist.isend(tensor, dst=self._global(instr.peer), tag=TAG)
            # the staged host copy lives until the send is done
            return _CheckedWork([work], lambda: None, (tensor,)) if self.staged else work
        header = self._outgoing(self._header(instr))
        works = [dist.isend(header, dst=self._global(instr.peer), tag=TAG),
                 dist.isend(tensor, dst=self._global(instr.peer), tag=TAG)]
        return _CheckedWork(works, lambda: None, (header, tensor))

    def irecv(self, instr: Instruction) -> tuple[Waitable, torch.Tensor]:
        # A buffer of its own, dropped once its backward has used it (the allocator
        # reuses the memory): only the checkpoints in use occupy the device.
        buffer = self.empty()
        src = self._global(instr.peer)
        if not self.checked:
            return self._post_irecv(buffer, src), buffer
        header = self._header_buffer(instr)
        works = [self._post_irecv(header, src), self._post_irecv(buffer, src)]
        return _CheckedWork(works, lambda: self._verify(instr, header), (header, buffer)), buffer
