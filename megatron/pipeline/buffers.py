"""A rank's device and pinned host buffers, sized from its program before the first
iteration: the parameter slots, the host pool the gradients land in, the gradient
offloader, and the device gradient buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.offload.device import DeviceLayer
from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader, default_grad_host_dtype
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.prefetch import ParamSlots
from megatron.pipeline.owner import OwnedStages
from megatron.schedules.instructions import BackwardStage, Schedule
from megatron.schedules.slot_plan import slot_numels
from megatron.schedules.validator import ValidationReport


@dataclass(frozen=True)
class RankBuffers:
    param_slots: ParamSlots
    host_pool: HostBufferPool
    offloader: GradientOffloader
    grad_buffers: GradientBuffers


def rank_buffers(device: DeviceLayer, dtype: torch.dtype, rank: int,
                 stage_numel: dict[BackwardStage, int], owned: OwnedStages,
                 schedules: tuple[Schedule, Schedule], training: ValidationReport,
                 host_gradient_dtype: torch.dtype | None = None) -> RankBuffers:
    """Parameter slots for the stages this rank's training and evaluation programs (of
    `schedules`) hold at once, each as large as the stages it takes (slot_plan.py; at
    least two: one computes while the next is prefetched); a pinned pool of one buffer per
    owned stage in `host_gradient_dtype` (None: the working dtype's default; a stage's buffer goes
    back when its update is published, before its next offload); gradient buffers for the
    backward stages in flight at once, plus one so the next starts while the previous one's
    offload runs, in the host gradients' dtype (with a micro-batch's buffer in `dtype` when
    that is narrower: see GradientBuffers)."""
    numels = slot_numels(schedules, rank, stage_numel)
    param_slots = ParamSlots.sized(device, list(numels), dtype)
    offloader_dtype = host_gradient_dtype or default_grad_host_dtype(dtype)
    host_pool = HostBufferPool(
        device, sum(owner.numel for owner in owned.values()) * offloader_dtype.itemsize or 1)
    offloader = GradientOffloader(device, host_pool, offloader_dtype, training_dtype=dtype)
    in_flight = training.peak_gradients[rank]
    # summed in the main gradients' dtype, which the offload then copies as it is
    grad_buffers = GradientBuffers(device, owned.largest, offloader_dtype,
                                   min(in_flight + 1, max(1, len(owned))), working_dtype=dtype)
    return RankBuffers(param_slots, host_pool, offloader, grad_buffers)
