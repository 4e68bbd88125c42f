"""Device updates of optimizer subgroups on the device layer (Deep Optimizer States,
Algorithm 1): per subgroup, fp32 p, m, v and the gradient move in on a dedicated H2D
stream, the AdamW step runs on an update stream (adam_step_torch: the C++ kernel's
arithmetic), and p, m, v and the 16-bit copy are flushed back on a dedicated D2H stream.
Two buffer slots alternate, so one subgroup's flush (D2H) and the next one's load (H2D)
are in flight at once (full duplex); a slot is reloaded only after its flush (an event,
no host wait). Device memory: the two slots, fixed at construction, accounted under
"optimizer_subgroups".
"""

from __future__ import annotations

import threading

import torch

from megatron.offload.device import DeviceLayer, Event
from megatron.optimizer.subgroups import AdamHyper, adam_step_torch


def default_subgroup_size(largest_group: int) -> int:
    """An eighth of the largest group split, at least 4096 parameters: enough subgroups
    for the stride to interleave, each large enough to keep the copies efficient."""
    return max(4096, -(-largest_group // 8))


class _Slot:
    def __init__(self, device: DeviceLayer, numel: int) -> None:
        self.p, self.m, self.v, self.g = (device.empty(numel, torch.float32) for _ in range(4))
        self.out: dict[torch.dtype, torch.Tensor] = {}
        self.flags = device.zeros(2, torch.float64)
        self.free: Event | None = None  # the last flush out of this slot


class _Launched:
    """One subgroup in flight; result() waits for its flush (on the optimizer's thread)."""

    def __init__(self, flushed: Event, flags: torch.Tensor) -> None:
        self._flushed = flushed
        self._flags = flags

    def result(self) -> tuple[bool, float]:
        self._flushed.wait()
        finite = bool(self._flags[0] > 0)
        return finite, float(self._flags[1]) if finite else float("inf")


class DeviceSubgroupUpdater:
    """Implements megatron.optimizer.subgroups.DeviceUpdater on a DeviceLayer for
    subgroups of at most `max_numel` elements."""

    SLOTS = 2

    def __init__(self, device: DeviceLayer, max_numel: int) -> None:
        self.device = device
        self.max_numel = int(max_numel)
        self.h2d = device.side_stream("optimizer-h2d")
        self.update = device.side_stream("optimizer-update")
        self.d2h = device.side_stream("optimizer-d2h")
        self._slots = [_Slot(device, self.max_numel) for _ in range(self.SLOTS)]
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
        return DeviceSubgroupUpdater.SLOTS * max_numel * (16 + out_itemsize)

    def launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, hyper: AdamHyper) -> _Launched:
        with self._lock:
            return self._launch(p, m, v, grad, out, hyper)

    def _launch(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                out: torch.Tensor | None, hyper: AdamHyper) -> _Launched:
        n = p.numel()
        if n > self.max_numel:
            raise ValueError(f"subgroup of {n} elements; the device slots hold {self.max_numel}")
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        bp, bm, bv, bg = slot.p[:n], slot.m[:n], slot.v[:n], slot.g[:n]
        bout = None
        if out is not None:
            if out.dtype not in slot.out:
                slot.out[out.dtype] = self.device.empty(self.max_numel, out.dtype)
            bout = slot.out[out.dtype][:n]
        if slot.free is not None:
            self.h2d.wait_event(slot.free)

        def load() -> None:
            for dst, src in ((bp, p), (bm, m), (bv, v), (bg, grad)):
                dst.copy_(src, non_blocking=True)
        self.h2d.submit(load)
        self.update.wait_event(self.h2d.record_event())

        def step() -> None:
            with self.device.on(self.update):
                finite, sq = adam_step_torch(bp, bm, bv, bg, hyper)
                slot.flags[0] = finite
                slot.flags[1] = sq
                if bout is not None:
                    bout.copy_(bp)
        self.update.submit(step)
        self.d2h.wait_event(self.update.record_event())
        flags = self.device.pin_host(2, torch.float64)

        def flush() -> None:
            with self.device.on(self.d2h):
                for dst, src in ((p, bp), (m, bm), (v, bv)):
                    dst.copy_(src, non_blocking=True)
                if bout is not None:
                    out.copy_(bout, non_blocking=True)
                flags.copy_(slot.flags, non_blocking=True)
        self.d2h.submit(flush)
        slot.free = self.d2h.record_event()
        self.launched += 1
        return _Launched(slot.free, flags)
