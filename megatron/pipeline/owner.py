"""What the rank that owns a backward stage keeps for it, and the optimizer calls on it.

The owner of backward stage (i, k) runs its backward, accumulates its parameter gradients
in one flat device buffer, offloads them, and steps its two CPU AdamW groups (elements
that take weight decay, then those that do not) into the stage's shared-memory segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader, GradientsReady
from megatron.offload.shm import SharedSegment
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.group_optimizer import AsyncGroupOptimizer
from megatron.schedules.instructions import BackwardStage


@dataclass
class BackwardStageOwner:
    """One owned backward stage: gradient buffer, optimizer groups and segment."""

    backward_stage: BackwardStage
    numel: int
    groups: tuple[int, int]  # CPU AdamW group of the decayed / the non-decayed elements
    split: int  # elements [0, split) are in the first group, the rest in the second
    segment: SharedSegment
    # Flat, on the device, in the training dtype: lent by the pool from the stage's first
    # backward of the iteration until its offload.
    grad: torch.Tensor | None = None
    offloaded: GradientsReady | None = None
    submitted: bool = False

    def bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (0, self.split), (self.split, self.numel)

    def start_iteration(self) -> None:
        self.offloaded = None
        self.submitted = False

    def gradient_buffer(self, buffers: GradientBuffers) -> torch.Tensor:
        """The device buffer the backward accumulates into (borrowed at the first use)."""
        if self.grad is None:
            self.grad = buffers.acquire(self.numel)
        return self.grad

    def offload(self, offloader: GradientOffloader, buffers: GradientBuffers) -> None:
        """Queue the D2H copy; the device buffer returns to the pool behind it."""
        if self.grad is None:
            raise RuntimeError(f"OFFLOAD_GRAD of backward stage {self.backward_stage} "
                               "before any backward")
        self.offloaded = offloader.offload(self.backward_stage, self.grad)
        buffers.release(self.grad, after=self.offloaded.event)
        self.grad = None

    def _landed(self, what: str) -> GradientsReady:
        if self.offloaded is None:
            raise RuntimeError(f"{what} of backward stage {self.backward_stage} before its "
                               "OFFLOAD_GRAD")
        return self.offloaded

    def step(self, optimizer: AsyncGroupOptimizer) -> None:
        """Submit both groups' steps; each starts when the gradients have landed."""
        ready = self._landed("OPTIMIZER_START")
        out = self.segment.params
        for group, (lo, hi) in zip(self.groups, self.bounds()):
            if hi > lo:
                optimizer.submit(group, ready.host[lo:hi], ready=ready, out=out[lo:hi])
        self.submitted = True

    def check(self, optimizer: AsyncGroupOptimizer) -> None:
        """Submit the overflow check of both groups' gradients (no update)."""
        ready = self._landed("the overflow check")
        for group, (lo, hi) in zip(self.groups, self.bounds()):
            if hi > lo:
                optimizer.check(group, ready.host[lo:hi], ready=ready)

    def master(self, adam: CPUAdamW) -> torch.Tensor:
        """The stage's fp32 masters in layout order (its two groups, joined)."""
        return torch.cat([adam.master(g) for g in self.groups])[:self.numel]

    def publish(self, iteration: int) -> None:
        """Give the host gradient buffer back and publish the segment's new version."""
        self.publisher(iteration)()

    def publisher(self, iteration: int) -> Callable[[], None]:
        """publish(iteration), bound now, to run once the stage's last correction of the
        iteration is done (possibly on an optimizer thread, while the next iteration has
        started and offloads into a new buffer)."""
        offloaded, self.offloaded = self.offloaded, None
        segment = self.segment

        def publish() -> None:
            if offloaded is not None:
                offloaded.release()
            segment.publish(iteration)
        return publish
