"""A rank's device and pinned host buffers, sized from its program before the first
iteration: the parameter slots, the host pool the gradients land in, the gradient
offloader, and the device gradient buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.offload.device import DeviceLayer
from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader
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
                 schedules: tuple[Schedule, Schedule], training: ValidationReport
                 ) -> RankBuffers:
    """Parameter slots for the stages this rank's training and evaluation programs (of
    `schedules`) hold at once, each as large as the stages it takes (slot_plan.py; at
    least two: one computes while the next is prefetched); a pinned pool for every owned
    stage's gradients (fp32 at most); gradient buffers for the backward stages in flight at
    once, plus one so the next starts while the previous one's offload runs."""
    numels = slot_numels(schedules, rank, stage_numel)
    param_slots = ParamSlots.sized(device, list(numels), dtype)
    host_pool = HostBufferPool(device, sum(4 * owner.numel for owner in owned.values()) or 1)
    offloader = GradientOffloader(device, host_pool, training_dtype=dtype)
    in_flight = training.peak_gradients[rank]
    grad_buffers = GradientBuffers(device, owned.largest, dtype,
                                   min(in_flight + 1, max(1, len(owned))))
    return RankBuffers(param_slots, host_pool, offloader, grad_buffers)
