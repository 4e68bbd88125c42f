"""Device gradient buffers lent to backward stages only while their backward runs.

A backward stage sums its parameter gradients over all micro-batches in one flat device
buffer, in the dtype of the main gradients (megatron.config.run.host_gradient_dtype: what
is offloaded, reduced and read by the optimizer); after its last micro-batch the buffer is
offloaded to host memory and goes back to the pool. The pool holds as many buffers as the
schedule has backward stages in flight at once on this rank (the validator counts them),
plus one so that the next stage can start while the previous one's D2H copy is still
running: device memory for gradients does not grow with the number of backward stages a
rank owns.

Main gradients wider than the working dtype (fp32 for a bf16 or fp16 run, Megatron-LM's
default) are summed as Megatron-LM sums them: each micro-batch's backward writes its
gradients in the working dtype (autograd's own dtype) into one more buffer, which is then
added into the wide sum and cleared. Summed in bf16 instead, every addition would round to
bf16's 8-bit significand and the sum would drift with the number of micro-batches. The
addition widens a chunk at a time into a scratch of the layer's (UPCAST_CHUNK elements at
most) and adds from there: a mixed-dtype add on the CPU would first copy the whole stage to
fp32 where no book sees it; on CUDA it is a copy kernel more per chunk.
"""

from __future__ import annotations

from collections import deque

import torch

from megatron.offload.device import DeviceLayer, Event
from megatron.schedules.memory_model import UPCAST_CHUNK


class GradientBuffers:
    def __init__(self, device: DeviceLayer, numel: int, dtype: torch.dtype, count: int,
                 working_dtype: torch.dtype | None = None,
                 widen_chunk: int = UPCAST_CHUNK) -> None:
        """`count` buffers of `numel` elements in `dtype` (the main gradients'); with a
        `working_dtype` other than it, one more buffer in that dtype for a micro-batch's
        gradients (`micro_batch_gradients`) and a scratch of `widen_chunk` elements (at
        most `numel`) in `dtype` that `accumulate` widens them through."""
        if count < 1 or numel < 1:
            raise ValueError(f"{count} gradient buffers of {numel} elements: expected >= 1 each")
        self.device = device
        self.numel = numel
        # (buffer, event after which it may be overwritten): the oldest release first.
        self._free: deque[tuple[torch.Tensor, Event | None]] = deque(
            (device.empty(numel, dtype, name=f"gradient buffer {i}"), None) for i in range(count))
        self._micro_batch = self._widened = None
        if working_dtype not in (None, dtype):
            if widen_chunk < 1:
                raise ValueError(f"widen_chunk={widen_chunk}: expected >= 1")
            self._micro_batch = device.empty(numel, working_dtype, name="micro-batch gradients")
            self._widened = device.empty(min(numel, widen_chunk), dtype,
                                         name="micro-batch gradients widened")
        self.nbytes = sum(buffer.nbytes for buffer, _ in self._free) + sum(
            t.nbytes for t in (self._micro_batch, self._widened) if t is not None)

    def acquire(self, numel: int) -> torch.Tensor:
        """A zeroed flat buffer of `numel` elements on the device."""
        if numel > self.numel:
            raise ValueError(f"a gradient buffer of {numel} elements; the pool's hold {self.numel}")
        if not self._free:
            raise RuntimeError("every gradient buffer is in use: more backward stages in flight "
                               "than the schedule's validator counted")
        buffer, freed = self._free.popleft()
        if freed is not None:  # stream-ordered reuse after the D2H copy out of it
            self.device.compute_stream.wait_event(freed)
        view = buffer[:numel]
        self._zero(view, "zeroing a gradient buffer")
        return view

    def micro_batch_gradients(self, total: torch.Tensor) -> torch.Tensor:
        """Where one micro-batch's backward writes the gradients summed into `total` (an
        acquired buffer): `total` itself when it is in the working dtype, else the zeroed
        working-dtype buffer that `accumulate` adds into it."""
        if self._micro_batch is None:
            return total
        view = self._micro_batch[:total.numel()]
        self._zero(view, "zeroing the micro-batch gradients")
        return view

    def accumulate(self, total: torch.Tensor, micro_batch: torch.Tensor) -> None:
        """After the backward that wrote `micro_batch` (micro_batch_gradients(total)): add it
        into `total`, widened to `total`'s dtype; nothing when the backward summed in place."""
        if micro_batch is total:
            return
        compute, chunk = self.device.compute_stream, self._widened.numel()
        self.device.checks.kernel(compute, reads=(micro_batch,), writes=(total, self._widened),
                                  what="adding a micro-batch's gradients into their sum")
        with self.device.on(compute):
            for lo in range(0, total.numel(), chunk):
                hi = min(lo + chunk, total.numel())
                widened = self._widened[:hi - lo]
                widened.copy_(micro_batch[lo:hi])
                total[lo:hi].add_(widened)

    def _zero(self, view: torch.Tensor, what: str) -> None:
        compute = self.device.compute_stream
        self.device.checks.kernel(compute, writes=(view,), what=what)
        with self.device.on(compute):
            view.zero_()

    def release(self, view: torch.Tensor, after: Event) -> None:
        """`view` may be reused once `after` (its offload copy) has completed."""
        base = view._base if view._base is not None else view
        self._free.append((base, after))
