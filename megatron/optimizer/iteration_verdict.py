"""The iteration's verdict: one all-reduce of the overflow flags and the squared norms of
every group's gradient over the process group decides, for all ranks alike, whether the
iteration overflowed, its global gradient norm and the clip factor (Megatron's)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Verdict:
    """What the overflow all-reduce decided for the whole iteration."""

    overflow: bool
    grad_norm: float
    clip: float  # the clip factor (1.0: no clipping)
    overflow_groups: tuple[int, ...]  # local groups whose gradient was not finite


def clip_factor(grad_norm: float, clip_grad: float) -> float:
    """The factor on the gradient for a global norm of `grad_norm` (clip_grad 0: none):
    Megatron's clip coefficient clip_grad / (grad_norm + 1e-6), applied whenever it is
    below 1 (so a norm within 1e-6 under clip_grad is scaled too, as there and in torch's
    clip_grad_norm_)."""
    if clip_grad <= 0.0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, clip_grad / (grad_norm + 1e-6))


def _all_reduce(local_overflow: bool, local_sq: float,
                process_group: dist.ProcessGroup | None) -> tuple[bool, float]:
    flags = torch.tensor([1.0 if local_overflow else 0.0, local_sq], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=process_group)
    return bool(flags[0].item() > 0), float(flags[1].item())


def reach_verdict(checks: Mapping[int, tuple[bool, float]], clip_grad: float,
                  process_group: dist.ProcessGroup | None) -> Verdict:
    """The verdict over the local groups' checks (group: (finite, sum of squares))."""
    overflow_groups = tuple(g for g, (finite, _) in sorted(checks.items()) if not finite)
    local_sq = sum(sq for finite, sq in checks.values() if finite)
    overflow, global_sq = _all_reduce(len(overflow_groups) > 0, local_sq, process_group)
    grad_norm = math.inf if overflow else math.sqrt(global_sq)
    return Verdict(overflow, grad_norm, clip_factor(grad_norm, clip_grad), overflow_groups)
