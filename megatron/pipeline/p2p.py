"""Point-to-point communication of activations, gradients and checkpoints.

Blocking send/recv for activations and gradients (they are on the critical path anyway);
isend/irecv for activation checkpoints, posted at the same step on both sides and waited
on only before the recompute that needs them (S section 4).

Every message carries a tag derived from what it moves, so that a checkpoint and an
activation between the same two ranks can never be matched with each other, whatever
order gloo delivers them in. NCCL ignores tags and matches in posting order, which the
schedule keeps identical on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.schedules.instructions import Instruction

_ROLE_CODES = {"act": 0, "grad": 1, "ckpt": 2}


@dataclass(frozen=True)
class MessageShape:
    shape: tuple[int, ...]
    dtype: torch.dtype


def message_tag(instr: Instruction, forward_stages: int, backward_split: int,
                micro_batches: int) -> int:
    """A tag unique within an iteration for the tensor `instr` moves (equal on both sides)."""
    role = _ROLE_CODES[instr.role]
    position = instr.stage * (backward_split + 1) + (instr.sub + 1)
    slots = forward_stages * (backward_split + 1)
    return (role * slots + position) * micro_batches + instr.mb


class PointToPoint:
    """Sends and receives [s, b, h] tensors between pipeline ranks."""

    def __init__(self, shape: MessageShape, forward_stages: int, backward_split: int,
                 micro_batches: int, device: torch.device) -> None:
        self.shape = shape
        self.device = device
        self._dims = (forward_stages, backward_split, micro_batches)
        # Receive buffers for checkpoints, reused every iteration: the communication plan
        # of a schedule is the same in every iteration.
        self._ckpt_buffers: dict[tuple, torch.Tensor] = {}

    def tag(self, instr: Instruction) -> int:
        return message_tag(instr, *self._dims)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape.shape, dtype=self.shape.dtype, device=self.device)

    def send(self, instr: Instruction, tensor: torch.Tensor) -> None:
        dist.send(tensor.contiguous(), dst=instr.peer, tag=self.tag(instr))

    def recv(self, instr: Instruction) -> torch.Tensor:
        buffer = self.empty()
        dist.recv(buffer, src=instr.peer, tag=self.tag(instr))
        return buffer

    def isend(self, instr: Instruction, tensor: torch.Tensor) -> dist.Work:
        return dist.isend(tensor.contiguous(), dst=instr.peer, tag=self.tag(instr))

    def irecv(self, instr: Instruction) -> tuple[dist.Work, torch.Tensor]:
        key = instr.tensor_key
        buffer = self._ckpt_buffers.get(key)
        if buffer is None:
            buffer = self._ckpt_buffers[key] = self.empty()
        return dist.irecv(buffer, src=instr.peer, tag=self.tag(instr)), buffer
