"""Device updates of optimizer subgroups on the device layer (Deep Optimizer States,
Algorithm 1): per subgroup, fp32 p, m, v and the gradient move in on a dedicated H2D
stream, the AdamW step runs on an update stream (adam_step_torch: the C++ kernel's
arithmetic), and p, m, v and the 16-bit copy are flushed back on a dedicated D2H stream.
Two buffer slots alternate, so one subgroup's flush (D2H) and the next one's load (H2D)
are in flight at once (full duplex); a slot is reloaded only after its flush (an event,
no host wait), so consecutive device subgroups (a GPU-heavy split) never hold a third.
Device memory: the two slots, fixed at construction, accounted under
"optimizer_subgroups"; the assembly sizes them to fit in what the gradient buffers hold
(free once the backward has ended), so the update's device memory stays within that.

Every buffer is allocated on the stream that first uses it (empty, never zero-filled: a
fill would be a kernel on the caller's stream that the update stream does not wait for),
and every operation declares what it touches, so that on CUDA the stream keeps the
buffers a launch dropped alive until it has run (see megatron/offload/device.py).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from megatron.offload.device import DeviceLayer, Event, Stream
from megatron.optimizer.rounding import StateFormat
from megatron.optimizer.subgroups import AdamHyper, adam_step_torch
from megatron.schedules.subgroup_memory import SUBGROUP_SLOTS, subgroup_slots_bytes

# The device layer's book of every buffer below: the optimizer threads allocate and free
# them while the executor reads the device memory, which takes this part from the layer's
# snapshot (DeviceLayer.device_snapshot) rather than from the updaters' own sums.
SUBGROUP_BOOK = "optimizer_subgroups"


class _Slot:
    def __init__(self, device: DeviceLayer, numel: int, index: int, loaded_on: Stream,
                 written_on: Stream) -> None:
        self.p, self.m, self.v, self.g = (
            device.empty(numel, torch.float32, name=f"optimizer slot {index} {what}",
                         stream=loaded_on, book=SUBGROUP_BOOK)
            for what in ("p", "m", "v", "gradient"))
        self.out: dict[torch.dtype, torch.Tensor] = {}
        # written by each step before it is read
        self.flags = device.empty(2, torch.float64, name=f"optimizer slot {index} flags",
                                  stream=written_on, book=SUBGROUP_BOOK)
        self.free: Event | None = None  # the last flush out of this slot


class _Launched:
    """One subgroup in flight; result() waits for its flush (on the optimizer's thread)."""

    def __init__(self, flushed: Event, flags: torch.Tensor, device: DeviceLayer) -> None:
        self._flushed = flushed
        self._flags = flags
        self._device = device

    def result(self) -> tuple[bool, float]:
        self._flushed.wait()
        self._device.checks.host_read(self._flags, what="the optimizer reads a subgroup's flags")
        finite = bool(self._flags[0] > 0)
        return finite, float(self._flags[1]) if finite else float("inf")


class DeviceSubgroupUpdater:
    """Implements megatron.optimizer.subgroups.DeviceUpdater on a DeviceLayer for
    subgroups of at most `max_numel` elements."""

    SLOTS = SUBGROUP_SLOTS

    def __init__(self, device: DeviceLayer, max_numel: int) -> None:
        self.device = device
        self.max_numel = int(max_numel)
        self.h2d = device.side_stream("optimizer-h2d")
        self.update = device.side_stream("optimizer-update")
        self.d2h = device.side_stream("optimizer-d2h")
        self._slots = [_Slot(device, self.max_numel, i, self.h2d, self.update)
                       for i in range(self.SLOTS)]
        self._next = 0
        # Groups step concurrently (one optimizer thread each): a slot's reuse and the
        # order of the streams' work are decided under this lock.
        self._lock = threading.Lock()
        self.launched = 0  # subgroups updated on the device so far

    @property
    def nbytes(self) -> int:
        """Device memory held (the slots: p, m, v, gradient in fp32, the 16-bit copy)."""
        return sum(4 * s.p.numel() * 4 + sum(o.nbytes for o in s.out.values()) + s.flags.nbytes
                   for s in self._slots)

    @staticmethod
    def bytes_needed(max_numel: int, out_itemsize: int = 2) -> int:
        return subgroup_slots_bytes(max_numel, out_itemsize)

    def launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, hyper: AdamHyper,
               fmt: StateFormat | None = None) -> _Launched:
        with self._lock:
            return self._launch(p, m, v, grad, out, hyper, fmt)

    def _launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                out: torch.Tensor | None, hyper: AdamHyper,
                fmt: StateFormat | None) -> _Launched:
        n = p.numel()
        if n > self.max_numel:
            raise ValueError(f"subgroup of {n} elements; the device slots hold {self.max_numel}")
        slot_index = self._next
        slot = self._slots[slot_index]
        self._next = (self._next + 1) % len(self._slots)
        bp, bm, bv, bg = slot.p[:n], slot.m[:n], slot.v[:n], slot.g[:n]
        bout = None
        if out is not None:
            if out.dtype not in slot.out:
                slot.out[out.dtype] = self.device.empty(
                    self.max_numel, out.dtype, name=f"optimizer slot {slot_index} out",
                    stream=self.update, book=SUBGROUP_BOOK)
            bout = slot.out[out.dtype][:n]
        if slot.free is not None:
            self.h2d.wait_event(slot.free)

        def load() -> None:
            for dst, src in ((bp, p), (bm, m), (bv, v), (bg, grad)):
                dst.copy_(src, non_blocking=True)
        self.h2d.submit(load, reads=(p, m, v, grad), writes=(bp, bm, bv, bg),
                        what="loading a subgroup")
        self.update.wait_event(self.h2d.record_event())

        def step() -> None:
            with self.device.on(self.update):
                finite, sq = adam_step_torch(bp, bm, bv, bg, hyper, fmt)
                slot.flags[0] = finite
                slot.flags[1] = sq
                if bout is not None:
                    bout.copy_(bp)
        written = (bp, bm, bv, slot.flags) + (() if bout is None else (bout,))
        self.update.submit(step, reads=(bg,), writes=written, what="a subgroup's AdamW step")
        self.d2h.wait_event(self.update.record_event())
        flags = self.device.pin_host(2, torch.float64, name="subgroup flags")

        def flush() -> None:
            with self.device.on(self.d2h):
                for dst, src in ((p, bp), (m, bm), (v, bv)):
                    dst.copy_(src, non_blocking=True)
                if bout is not None:
                    out.copy_(bout, non_blocking=True)
                flags.copy_(slot.flags, non_blocking=True)
        host = (p, m, v, flags) + (() if out is None else (out,))
        self.d2h.submit(flush, reads=written, writes=host, what="flushing a subgroup")
        slot.free = self.d2h.record_event()
        self.launched += 1
        return _Launched(slot.free, flags, self.device)

    def to_host(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing to do: every update flushed p, m, v before it counted as done."""
        return None

    def forget(self, p: torch.Tensor) -> None:
        """Nothing to do: no device copy outlives an update."""
        return None


class ResidentSubgroupUpdater:
    """The static baseline (Twin-Flow, megatron-core's HybridDeviceOptimizer
    offload_fraction): the subgroups it is given keep fp32 p, m, v in device memory for
    good. A step moves only the gradient in and the 16-bit copy out. The host copy is
    brought up to date only when the host needs it (to_host: a rollback, a correction, a
    checkpoint), and reloaded after the host changed it (forget). Device memory: 12 bytes
    per resident parameter plus the gradient and 16-bit staging of the largest subgroup."""

    def __init__(self, device: DeviceLayer) -> None:
        self.device = device
        self.h2d = device.side_stream("resident-h2d")
        self.update = device.side_stream("resident-update")
        self.d2h = device.side_stream("resident-d2h")
        self._state: dict[int, tuple[torch.Tensor, ...]] = {}  # host p address -> p, m, v, g
        self._host_stale: set[int] = set()
        self._lock = threading.Lock()
        self._staging = 0  # bytes of launches' out and flags not freed yet
        # Its own lock, held for an addition only: the finalizer that frees a launch's
        # buffers runs on whichever thread drops them last (a stream's worker, while
        # to_host waits for that stream under self._lock); re-entrant, as a finalizer may
        # run inside it
        self._staging_lock = threading.RLock()
        self.launched = 0

    @property
    def nbytes(self) -> int:
        """Device memory held: the resident states and gradients, and the staging of the
        launches whose buffers are still referenced (until their flush has run)."""
        with self._lock:  # optimizer threads add subgroups while the executor reads this
            held = sum(t.nbytes for tensors in self._state.values() for t in tensors)
        with self._staging_lock:
            return held + self._staging

    def _staged(self, tensor: torch.Tensor) -> None:
        """Count a launch's buffer until its last reference is gone."""
        with self._staging_lock:
            self._staging += tensor.nbytes
        weakref.finalize(tensor, self._unstaged, tensor.nbytes)

    def _unstaged(self, nbytes: int) -> None:
        with self._staging_lock:
            self._staging -= nbytes

    def launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, hyper: AdamHyper,
               fmt: StateFormat | None = None) -> _Launched:
        with self._lock:
            key = p.data_ptr()
            loads: list[tuple[torch.Tensor, torch.Tensor]] = []
            if key not in self._state:
                n = p.numel()
                self._state[key] = tuple(
                    self.device.empty(n, torch.float32, name=f"resident subgroup {what}",
                                      stream=self.h2d, book=SUBGROUP_BOOK)
                    for what in ("p", "m", "v", "gradient"))
                loads += list(zip(self._state[key][:3], (p, m, v)))
            dp, dm, dv, dg = self._state[key]
            loads.append((dg, grad))
            # dout and flags: written by the step, read by the flush; dropped when this
            # returns (the streams' keep-alive holds them until the flush has run)
            dout = None if out is None else self.device.empty(
                out.numel(), out.dtype, name="resident subgroup out", stream=self.update,
                book=SUBGROUP_BOOK)
            flags = self.device.empty(2, torch.float64, name="resident subgroup flags",
                                      stream=self.update, book=SUBGROUP_BOOK)
            for staged in (flags,) if dout is None else (flags, dout):
                self._staged(staged)

            def load() -> None:
                for dst, src in loads:
                    dst.copy_(src, non_blocking=True)
            self.h2d.submit(load, reads=[src for _, src in loads],
                            writes=[dst for dst, _ in loads], what="loading a subgroup")
            self.update.wait_event(self.h2d.record_event())

            def step() -> None:
                with self.device.on(self.update):
                    finite, sq = adam_step_torch(dp, dm, dv, dg, hyper, fmt)
                    flags[0], flags[1] = finite, sq
                    if dout is not None:
                        dout.copy_(dp)
            written = (dp, dm, dv, flags) + (() if dout is None else (dout,))
            self.update.submit(step, reads=(dg,), writes=written, what="a subgroup's AdamW step")
            self.d2h.wait_event(self.update.record_event())
            host_flags = self.device.pin_host(2, torch.float64, name="subgroup flags")

            def flush() -> None:
                with self.device.on(self.d2h):
                    if dout is not None:
                        out.copy_(dout, non_blocking=True)
                    host_flags.copy_(flags, non_blocking=True)
            host = (host_flags,) + (() if out is None else (out,))
            self.d2h.submit(flush, reads=(flags,) + (() if dout is None else (dout,)),
                            writes=host, what="flushing a subgroup")
            self._host_stale.add(key)
            self.launched += 1
            return _Launched(self.d2h.record_event(), host_flags, self.device)

    def to_host(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        with self._lock:
            key = p.data_ptr()
            if key not in self._host_stale:
                return
            self.d2h.synchronize()  # the last update of this subgroup is done
            self.device.checks.host_read(*self._state[key][:3],  # a synchronous copy to the host
                                  what="writing a resident subgroup back")
            for dst, src in zip((p, m, v), self._state[key][:3]):
                dst.copy_(src)
            self._host_stale.discard(key)

    def forget(self, p: torch.Tensor) -> None:
        with self._lock:
            self._state.pop(p.data_ptr(), None)
            self._host_stale.discard(p.data_ptr())


@dataclass(frozen=True)
class DeviceSubgroups:
    """The share of this rank's optimizer updates the device takes, as the assembly
    planned it: the subgroups `stride` places on the device (a split of
    megatron/schedules/optimizer_stride.py: every K-th, or -N: all but every N-th; 0: none)
    of the stages whose program says OPTIMIZER_START_SUBGROUPS, through `updater` (None:
    all on the CPU)."""

    stride: int = 0
    updater: DeviceSubgroupUpdater | ResidentSubgroupUpdater | None = None
