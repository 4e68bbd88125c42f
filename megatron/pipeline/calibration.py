"""Rates measured on this machine, for cost models calibrated from real runs."""

from __future__ import annotations

import time

import torch

from megatron.optimizer.cpu_adam import CPUAdamW


def optimizer_seconds_per_param(threads: int, numel: int = 1 << 20, repeats: int = 5) -> float:
    """Time of one CPU AdamW step per parameter (after one warm-up step)."""
    opt = CPUAdamW([torch.zeros(numel)], threads=threads)
    grad, out = torch.full((numel,), 1e-3), torch.empty(numel)
    opt.step_group(0, grad, out=out)
    start = time.perf_counter()
    for _ in range(repeats):
        opt.step_group(0, grad, out=out)
    return (time.perf_counter() - start) / repeats / numel


def copy_seconds_per_byte(numel: int = 1 << 22, repeats: int = 5) -> float:
    """Time of a host memory copy per byte (the CPU device layer's H2D/D2H)."""
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return (time.perf_counter() - start) / repeats / (4 * numel)
