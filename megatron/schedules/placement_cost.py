"""What a placement of the optimizer (megatron/config/placement.py) costs: the device
memory its updates hold on a rank (the memory model's "optimizer_subgroups") and the time
of its device updates (the simulator's DeviceUpdateCosts). One function each, chosen by
the kind of `DeviceShare`; a new placement registers its own here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import singledispatch

from megatron.config.placement import AutoSplit, DeviceShare, Interleaved, OnHost, Resident

from .cost_model import DeviceUpdateCosts
from .instructions import BackwardStage
from .optimizer_stride import UpdateRates
from .subgroup_memory import RESIDENT_BYTES_PER_PARAM, planned_subgroup_size, subgroup_slots_bytes


@dataclass(frozen=True)
class RankOptimizer:
    """One rank's optimizer as the memory model plans it."""

    owned_params: int  # parameters of the backward stages the rank owns
    # parameters of each owned stage its program updates in subgroups
    # (OPTIMIZER_START_SUBGROUPS: the lowering marked its update as exposed)
    subgroup_stages: tuple[int, ...]
    gradient_buffer_bytes: int  # what its gradient buffers hold, free after the backward
    param_bytes: int  # the working dtype's size (the subgroups' 16-bit copy)
    subgroup_size: int | None  # the placement's; None: from the largest stage


@singledispatch
def device_optimizer_bytes(updates: DeviceShare, rank: RankOptimizer) -> int:
    """Device bytes `updates` holds on `rank` for the optimizer step."""
    raise TypeError(f"no device memory is priced for the placement {updates!r}: register "
                    "it with device_optimizer_bytes.register")


@device_optimizer_bytes.register
def _(updates: OnHost, rank: RankOptimizer) -> int:
    return 0


@device_optimizer_bytes.register(Interleaved)
@device_optimizer_bytes.register(AutoSplit)
def _(updates: DeviceShare, rank: RankOptimizer) -> int:
    """Two subgroup slots, as the runtime sizes them: within what the gradient buffers
    hold (a stage's largest group taken as the whole stage: an upper bound)."""
    if not rank.subgroup_stages:
        return 0
    size = planned_subgroup_size(rank.subgroup_size, max(rank.subgroup_stages),
                                 rank.gradient_buffer_bytes)
    return subgroup_slots_bytes(size, rank.param_bytes)


@device_optimizer_bytes.register
def _(updates: Resident, rank: RankOptimizer) -> int:
    """fp32 p, m, v and a gradient buffer per resident parameter."""
    return RESIDENT_BYTES_PER_PARAM * round(updates.fraction * rank.owned_params)


@singledispatch
def device_update_costs(updates: DeviceShare, params: dict[BackwardStage, int],
                        rates: UpdateRates) -> DeviceUpdateCosts | None:
    """How the simulator prices the device's updates under `updates` (None: every update
    as a CPU update; the static split is priced so too)."""
    return None


@device_update_costs.register
def _(updates: Interleaved, params: dict[BackwardStage, int],
      rates: UpdateRates) -> DeviceUpdateCosts:
    return DeviceUpdateCosts(updates.split, params, rates)
