"""16-bit optimizer state: which element gets which random bits, and the torch side of
the rounding the C++ kernel does (csrc/adam_kernel.h), bit for bit.

m and v in bf16 round to nearest even. A bf16 master rounds stochastically: the fp32
result plus 16 random bits below bf16's mantissa, truncated, so an update smaller than
half a bf16 step still moves the weight with the right probability. The bits come from a
counter-based generator, a pure function of (seed, parameter, index inside the parameter,
step):

    key(seed, parameter, step) = fmix32(fmix32(fmix32(seed) ^ parameter) ^ step)
    h = fmix32((index >> 1) ^ key)
    bits(element) = h & 0xFFFF if index is even else h >> 16

fmix32 is murmur3's 32-bit finalizer, `parameter` the CRC-32 of the parameter's
whole-model name (GPTModel's). Elements 2j and 2j + 1 of a parameter share one hash, one
half each: a vector of lanes then hashes once per two elements, which is what keeps the
rounding off the critical path on AVX2 (docs/cpu_optimizer.md). Nothing depends on where
the element sits in a buffer, so the same parameter rounds the same way whatever the
pipeline shape, the optimizer groups, the subgroups, the thread count or the shard that
updates it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.config.run import optimizer_state_bytes

MASK32 = 0xFFFFFFFF


def fmix32(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def parameter_id(name: str) -> int:
    """The 32-bit identity of a parameter: CRC-32 of its whole-model name."""
    return zlib.crc32(name.encode())


def round_key(seed: int, parameter: int, step: int) -> int:
    return fmix32(fmix32(fmix32(seed) ^ (parameter & MASK32)) ^ (step & MASK32))


@dataclass(frozen=True)
class ElementRun:
    """Elements [lo, hi) of a group are elements first, first + 1, ... of `parameter`."""

    lo: int
    hi: int
    parameter: int
    first: int = 0


def kernel_runs(runs: Sequence[ElementRun], lo: int, hi: int, seed: int,
                step: int) -> list[list[int]]:
    """The kernel's rows (begin, end, index_base, key) for elements [lo, hi) of a group,
    relative to lo: element lo + k has index index_base + k (mod 2^32) in its parameter."""
    rows = []
    for r in runs:
        a, b = max(r.lo, lo), min(r.hi, hi)
        if a < b:
            rows.append([a - lo, b - lo, (r.first + lo - r.lo) & MASK32,
                         round_key(seed, r.parameter, step)])
    return rows


@dataclass(frozen=True)
class StateFormat:
    """How p (master) and m, v are stored; `rounding`: the kernel_runs rows (an int64
    tensor) when the master rounds stochastically, None when it rounds to nearest."""

    master: torch.dtype = torch.float32
    states: torch.dtype = torch.float32
    rounding: torch.Tensor | None = None


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x < 2^32 in int64, without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def random_bits(rows: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """bits(element) of the module docstring for elements [0, n) of `rows`, as int64."""
    rows = rows.to(device=device, dtype=torch.int64)
    lengths = rows[:, 1] - rows[:, 0]
    x = torch.repeat_interleave(rows[:, 2], lengths, output_size=n)
    index = (x + torch.arange(n, dtype=torch.int64, device=device)) & MASK32
    x = (index >> 1) ^ torch.repeat_interleave(rows[:, 3], lengths, output_size=n)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return torch.where((index & 1) == 1, x >> 16, x & 0xFFFF)


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to bf16 values with 16 random bits per element (kept in fp32)."""
    u = x.view(torch.int32).to(torch.int64) & MASK32
    u = (u + bits) & 0xFFFF0000
    u = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)
    return torch.where(torch.isnan(x), x, u.view(torch.float32))


def apply_format(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 fmt: StateFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 results of a step rounded as the stored state will hold them (still fp32)."""
    if fmt.states == torch.bfloat16:
        m = m.to(torch.bfloat16).to(torch.float32)
        v = v.to(torch.bfloat16).to(torch.float32)
    if fmt.master == torch.bfloat16:
        if fmt.rounding is None:
            p = p.to(torch.bfloat16).to(torch.float32)
        else:
            p = round_bf16_stochastic(p, random_bits(fmt.rounding, p.numel(), p.device))
    return p, m, v


def state_bytes_per_param(master: torch.dtype, states: torch.dtype) -> int:
    """Host bytes per parameter of the master and the two moments."""
    return optimizer_state_bytes(master.itemsize, states.itemsize)
