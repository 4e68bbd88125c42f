"""A device double buffer for stage parameters: one half computes, the other is prefetched.

    buf = ParamSlots(device, budget_bytes=2 * stage_bytes, dtype=torch.bfloat16)
    nxt = buf.prefetch((3, 1), segment.params)    # H2D copy on the h2d stream
    ... compute with the current slot ...
    buf.release(cur)                              # the half is free once compute passes here
    buf.bind(nxt, module, layout)                 # compute waits for the copy; params -> views
    ... forward / backward of stage (3, 1) ...

The slots are allocated once; binding only re-points `.data`, so nothing is allocated
per use. A rank's pipeline sizes each slot for the stages its programs put there
(`ParamSlots.sized`, from megatron/schedules/slot_plan.py) and gives a slot back where its
program fills it no more (`give_back`: the forward's slots, idle through an AFAB
schedule's backward, where the checkpoints peak); it is allocated again at its next fill,
the next iteration's. A prefetch into a released half first waits (on the h2d stream) for the compute
that used it, so a copy never overwrites parameters still in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megatron.offload.device import DeviceLayer, Event
from megatron.offload.layout import FlatLayout, bind_parameters
from megatron.schedules.instructions import BackwardStage


@dataclass
class Slot:
    """One half of the double buffer and the stage it holds."""

    index: int
    flat: torch.Tensor | None  # None: given back (`ParamSlots.give_back`) until its next fill
    capacity: int = 0  # elements
    key: BackwardStage | None = None
    numel: int = 0
    ready: Event | None = None  # the H2D copy of `key` has finished
    freed: Event | None = None  # compute no longer uses the previous contents
    in_use: bool = field(default=False)

    @property
    def params(self) -> torch.Tensor:
        """The stage's flat parameters in device memory."""
        return self.flat[: self.numel]


class ParamSlots:
    """Device slots for stages' parameters (two halves of `budget_bytes // 2` each by
    default), reused for every stage."""

    def __init__(
        self, device: DeviceLayer, budget_bytes: int, dtype: torch.dtype, slots: int = 2
    ) -> None:
        """`slots` equal parts of `budget_bytes`: two is the double buffer; a schedule that
        keeps more stages resident at once (its validator reports how many) asks for more."""
        if slots < 1:
            raise ValueError(f"slots={slots}: expected at least one")
        itemsize = torch.empty((), dtype=dtype).element_size()
        half_numel = budget_bytes // slots // itemsize
        if half_numel <= 0:
            raise ValueError(
                f"budget_bytes={budget_bytes}: too small for {slots} slots of {dtype} parameters"
            )
        self._allocate(device, dtype, [half_numel] * slots)

    @classmethod
    def sized(cls, device: DeviceLayer, numels: list[int], dtype: torch.dtype) -> ParamSlots:
        """One slot of `numels[i]` elements each (a slot plan's sizes)."""
        if not numels or min(numels) <= 0:
            raise ValueError(f"slot sizes {numels}: expected at least one, each > 0")
        slots = cls.__new__(cls)
        slots._allocate(device, dtype, list(numels))
        return slots

    def _allocate(self, device: DeviceLayer, dtype: torch.dtype, numels: list[int]) -> None:
        self.device = device
        self.dtype = dtype
        self.slots = [Slot(i, device.empty(n, dtype, name=f"parameter slot {i}"), n)
                      for i, n in enumerate(numels)]
        self.nbytes = sum(slot.flat.nbytes for slot in self.slots)
        self.budget_bytes = self.nbytes
        self.half_numel = max(numels)  # the largest stage a slot takes

    def resident(self, key: BackwardStage) -> Slot | None:
        """The slot already holding (or receiving) `key`, if any."""
        return next((s for s in self.slots if s.in_use and s.key == key), None)

    def prefetch(self, key: BackwardStage, source: torch.Tensor) -> Slot:
        """Start copying `source` (a stage's flat parameters) into a free half."""
        if (slot := self.resident(key)) is not None:
            return slot
        if source.numel() > self.half_numel:
            nbytes = source.numel() * source.element_size()
            raise ValueError(
                f"stage {key} needs {nbytes} bytes of parameters but one slot of the device "
                f"double buffer holds {self.half_numel * source.element_size()} "
                f"(budget_bytes={self.budget_bytes}); raise the budget or split stages finer"
            )
        if source.dtype != self.dtype:
            raise ValueError(
                f"stage {key}: parameters are {source.dtype}, buffer holds {self.dtype}"
            )
        free = [s for s in self.slots if not s.in_use]
        if not free:
            held = [s.key for s in self.slots]
            raise RuntimeError(
                f"prefetch of stage {key}: all {len(self.slots)} slots hold stages {held}; release one"
            )
        # the free slot of lowest index that is large enough (a slot plan's: the lowest)
        slot = next((s for s in free if s.capacity >= source.numel()), None)
        if slot is None:
            raise RuntimeError(
                f"prefetch of stage {key} ({source.numel()} elements): the free slots hold "
                f"{[s.capacity for s in free]}; the slot plan did not foresee this order")
        stream = self.device.h2d_stream
        if slot.flat is None:
            # allocated in the compute stream's order (as at the start): the copy waits for
            # the compute work queued so far, which may still use the memory it reuses
            slot.flat = self.device.empty(slot.capacity, self.dtype,
                                          name=f"parameter slot {slot.index}")
            self.nbytes += slot.flat.nbytes
            slot.freed = self.device.compute_stream.record_event()
        if slot.freed is not None:
            stream.wait_event(slot.freed)
        slot.key, slot.numel, slot.in_use = key, source.numel(), True
        slot.ready = self.device.copy_async(slot.params, source.reshape(-1), stream)
        return slot

    def wait_ready(self, slot: Slot) -> None:
        """Order the compute stream after the slot's copy (blocks the caller on the CPU)."""
        assert slot.ready is not None, f"slot {slot.index} was never prefetched"
        self.device.compute_stream.wait_event(slot.ready)

    def bind(self, slot: Slot, module: nn.Module, layout: FlatLayout) -> None:
        """Compute waits for the slot's copy, then `module`'s parameters view the slot."""
        if not slot.in_use or slot.numel != layout.numel:
            raise ValueError(
                f"slot {slot.index} holds stage {slot.key} ({slot.numel} elements), "
                f"the layout needs {layout.numel}"
            )
        self.wait_ready(slot)
        bind_parameters(module, layout, slot.params)

    def release(self, slot: Slot) -> None:
        """The stage in `slot` is done; its half can receive the next prefetch."""
        slot.freed = self.device.compute_stream.record_event()
        slot.in_use = False

    def give_back(self, slot: Slot) -> None:
        """A released slot the program fills no more: its memory goes back to the device
        (in the compute stream's order: work queued there before the release still reads
        it) and is allocated again at its next fill. The caller drops any other view of it
        (a module's parameters bound to it)."""
        if slot.in_use or slot.flat is None:
            raise RuntimeError(f"slot {slot.index} is in use or already given back")
        self.nbytes -= slot.flat.nbytes
        slot.flat, slot.ready, slot.freed, slot.key, slot.numel = None, None, None, None, 0
