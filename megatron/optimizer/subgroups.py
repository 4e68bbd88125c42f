"""Optimizer subgroups (Deep Optimizer States): a group's elements cut into runs of
`size`, some updated on the device (every K-th, or all but every N-th: the split of
megatron/schedules/optimizer_stride.py) while the C++ kernel updates the others.

This module holds what does not depend on how the device is reached: the plan (which
ranges, which on the device), the AdamW arithmetic in torch ops that matches the C++
kernel (csrc/adam_kernel.h: unscale, finite check, decay, lerp, addcmul, multiply by
1/sqrt(bc2), divide; float32 scalars computed in double as the kernel does), and the
interface of a device updater (the pipeline implements it on the device layer's streams).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron.optimizer.rounding import StateFormat, apply_format
from megatron.schedules.optimizer_stride import is_device_subgroup


@dataclass(frozen=True)
class Subgroup:
    """Elements [lo, hi) of a group; `on_device`: updated by the device updater."""

    lo: int
    hi: int
    on_device: bool


def plan_subgroups(numel: int, size: int, split: int) -> tuple[Subgroup, ...]:
    """A group of `numel` elements in subgroups of `size`; subgroup i (0-based) goes to the
    device when is_device_subgroup(i, split): (i + 1) % K == 0 for a stride K > 0
    (Algorithm 1), (i + 1) % N != 0 for a GPU-heavy split -N, none for 0."""
    if size < 1:
        raise ValueError(f"subgroup size={size} must be >= 1")
    if split == -1:
        raise ValueError("split=-1: a GPU-heavy split -N needs N >= 2 (use 1: all on the device)")
    count = max(1, math.ceil(numel / size))
    return tuple(Subgroup(i * size, min(numel, (i + 1) * size), is_device_subgroup(i, split))
                 for i in range(count))


def plan_resident(numel: int, size: int, fraction: float) -> tuple[Subgroup, ...]:
    """The static split (Twin-Flow): the first `fraction` of the elements, in subgroups
    of `size`, always on the device; the rest on the CPU."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must lie in [0, 1]")
    cut = int(round(numel * fraction))
    on = [Subgroup(lo, min(cut, lo + size), True) for lo in range(0, cut, max(1, size))]
    off = [Subgroup(lo, min(numel, lo + size), False) for lo in range(cut, numel, max(1, size))]
    return tuple(on + off) or (Subgroup(0, numel, False),)


@dataclass(frozen=True)
class AdamHyper:
    """The kernel's per-step scalars (float32 values computed in double)."""

    inv_scale: float
    clip: float
    decay: float
    one_minus_b1: float
    beta2: float
    one_minus_b2: float
    inv_bc2_sqrt: float
    eps: float
    neg_step: float

    @staticmethod
    def of(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int,
           inv_scale: float, clip: float) -> AdamHyper:
        b1, b2 = betas
        bc1 = 1.0 - b1 ** step
        bc2 = 1.0 - b2 ** step
        return AdamHyper(inv_scale, clip, 1.0 - lr * weight_decay, 1.0 - b1, b2, 1.0 - b2,
                         1.0 / math.sqrt(bc2), eps, -(lr / bc1))


def _f32(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=like.device)


def adam_step_torch(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                    h: AdamHyper, fmt: StateFormat | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One AdamW step of fp32 p, m, v in place, on any torch device, the kernel's
    arithmetic. Leaves p, m, v unchanged when the unscaled gradient is not finite (no host
    read: the choice is a select on the device). With `fmt`, the results are rounded as
    the kernel stores a bf16 state (kept in fp32: exactly representable). Returns
    (finite, sum of squares of the unscaled gradient) as one-element device tensors."""
    g = grad.to(torch.float32) * _f32(h.inv_scale, p)
    finite = torch.isfinite(g).all()
    sq = g.double().square().sum()
    g = g * _f32(h.clip, p)
    new_p = p * _f32(h.decay, p)
    new_m = m + _f32(h.one_minus_b1, p) * (g - m)
    new_v = v * _f32(h.beta2, p) + (_f32(h.one_minus_b2, p) * g) * g
    denom = new_v.sqrt() * _f32(h.inv_bc2_sqrt, p) + _f32(h.eps, p)
    new_p = new_p + (_f32(h.neg_step, p) * new_m) / denom
    if fmt is not None:
        new_p, new_m, new_v = apply_format(new_p, new_m, new_v, fmt)
    for dst, src in ((p, new_p), (m, new_m), (v, new_v)):
        dst.copy_(torch.where(finite, src, dst))
    return finite, sq


class SubgroupUpdate(Protocol):
    """A device subgroup update in flight; result() waits for its flush to host memory."""

    def result(self) -> tuple[bool, float]: ...


class DeviceUpdater(Protocol):
    """Updates host-resident state on the device (fp32, or bf16 widened on the device and
    rounded back as `fmt` says): moves p, m, v and the gradient in,
    steps them with adam_step_torch, flushes p, m, v (and the 16-bit copy into `out`)
    back. launch() returns at once."""

    def launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, hyper: AdamHyper,
               fmt: StateFormat | None = None) -> SubgroupUpdate: ...

    def to_host(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Before the host reads p, m, v: write back state the device keeps (a resident
        updater); a streaming updater has flushed already."""

    def forget(self, p: torch.Tensor) -> None:
        """After the host changed p, m, v: drop any device copy (reloaded on next use)."""
