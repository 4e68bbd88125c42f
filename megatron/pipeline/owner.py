"""What the rank that owns a backward stage keeps for it, and the optimizer calls on it.

The owner of backward stage (i, k) runs its backward, accumulates its parameter gradients
in one flat device buffer, offloads them, and steps its two CPU AdamW groups (elements
that take weight decay, then those that do not) into the stage's shared-memory segment.
`OwnedStages` holds a rank's owners and the end of each iteration's protocol: a stage's
deferred correction (overflow rollback or clipping) runs past the end of the iteration
and publishes the stage when done; the others publish at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader, GradientsReady
from megatron.offload.shm import SharedSegment
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.group_optimizer import AsyncGroupOptimizer
from megatron.optimizer.group_tasks import ReadySignal
from megatron.pipeline.zero import GradientReducer, ReducedGradient
from megatron.schedules.instructions import BackwardStage


@dataclass
class BackwardStageOwner:
    """One owned backward stage: gradient buffer, optimizer groups and segment."""

    backward_stage: BackwardStage
    numel: int
    groups: tuple[int, int]  # CPU AdamW group of the decayed / the non-decayed elements
    split: int  # elements [0, split) are in the first group, the rest in the second
    segment: SharedSegment
    # Flat, on the device, in the main gradients' dtype: lent by the pool from the stage's
    # first backward of the iteration until its offload.
    grad: torch.Tensor | None = None
    offloaded: GradientsReady | None = None
    submitted: bool = False
    # Data parallelism (ZeRO): the elements this process steps, the reduction of the
    # gradients across the data-parallel group (None: one replica), whether this process
    # writes the segment and publishes its versions itself (with D > 1 the pipeline
    # publishes once every replica's shard is in).
    shard: tuple[int, int] | None = None
    reducer: GradientReducer | None = None
    writes_segment: bool = True
    publishes: bool = True
    reduced: ReducedGradient | None = None
    # The deferred correction of the last iteration that needed one, running on an optimizer
    # thread (it publishes the stage when done); the stage's next use waits for it.
    correction: Future | None = None
    # The publish of this iteration, bound at its ROLLBACK_IF_OVERFLOW when the stage had
    # nothing to correct: run at the end of the iteration.
    pending_publish: Callable[[], None] | None = None

    def bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Elements of the two groups this process steps (empty runs as (x, x))."""
        lo, hi = self.shard if self.shard is not None else (0, self.numel)
        first_hi = max(lo, min(self.split, hi))
        second_lo = max(lo, self.split)
        return (lo, first_hi), (second_lo, max(second_lo, hi))

    def start_iteration(self) -> None:
        self.offloaded = None
        self.reduced = None
        self.submitted = False
        self.pending_publish = None

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
        if self.reducer is not None:  # across the data-parallel group, on its thread
            self.reduced = self.reducer.reduce(self.backward_stage, self.offloaded)

    def _landed(self, what: str) -> GradientsReady:
        if self.offloaded is None:
            raise RuntimeError(f"{what} of backward stage {self.backward_stage} before its "
                               "OFFLOAD_GRAD")
        return self.offloaded

    def _gradient(self, what: str) -> tuple[ReadySignal, Callable[[int, int], torch.Tensor]]:
        """The signal that the gradients are ready and the slice of elements [lo, hi):
        landed in host memory, or reduced across the data-parallel group."""
        landed = self._landed(what)
        if self.reduced is not None:
            return self.reduced.ready, self.reduced.slice
        return landed, lambda lo, hi: landed.host[lo:hi]

    def step(self, optimizer: AsyncGroupOptimizer, on_device: bool = False) -> None:
        """Submit both groups' steps; each starts when the gradients are ready. `on_device`:
        the groups were split into subgroups, some updated on the device
        (OPTIMIZER_START_SUBGROUPS); their plans route the device part."""
        if on_device and not optimizer.has_subgroups(self.groups):
            raise RuntimeError(f"backward stage {self.backward_stage} has no subgroups planned")
        ready, grad = self._gradient("OPTIMIZER_START")
        out = self.segment.params if self.writes_segment else None
        for group, (lo, hi) in zip(self.groups, self.bounds()):
            if hi > lo:
                optimizer.submit(group, grad(lo, hi), ready=ready,
                                 out=out[lo:hi] if out is not None else None)
        self.submitted = True

    def live_groups(self) -> list[int]:
        """The optimizer groups that hold elements (an empty one is a placeholder)."""
        return [g for g, (lo, hi) in zip(self.groups, self.bounds()) if hi > lo]

    def read_states(self, adam: CPUAdamW) -> None:
        """READ_OPTIMIZER_STATES: the groups' committed states into the host window."""
        for group in self.live_groups():
            adam.storage.request_read(group)

    def write_states(self, adam: CPUAdamW) -> None:
        """WRITE_OPTIMIZER_STATES: the groups' step results to the file, once stepped."""
        for group in self.live_groups():
            adam.storage.request_write(group)

    def check(self, optimizer: AsyncGroupOptimizer) -> None:
        """Submit the overflow check of both groups' gradients (no update)."""
        ready, grad = self._gradient("the overflow check")
        for group, (lo, hi) in zip(self.groups, self.bounds()):
            if hi > lo:
                optimizer.check(group, grad(lo, hi), ready=ready)

    def master(self, adam: CPUAdamW) -> torch.Tensor:
        """The masters of the elements this process steps, in layout order (a copy of
        those alone: this runs after a load, when m and v need no second copy)."""
        live = self.live_groups()
        return torch.cat([adam.master(g) for g in live]) if live else torch.zeros(0)

    def state(self, adam: CPUAdamW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Master, exp_avg and exp_avg_sq of the elements this process steps (copies)."""
        live = self.live_groups()
        return tuple(torch.cat([get(g) for g in live]) if live else torch.zeros(0)
                     for get in (adam.master, adam.exp_avg, adam.exp_avg_sq))

    def publish(self, iteration: int) -> None:
        """Give the host gradient buffer back and publish the segment's new version."""
        self.publisher(iteration)()

    def publisher(self, iteration: int) -> Callable[[], None]:
        """publish(iteration), bound now, to run once the stage's last correction of the
        iteration is done (possibly on an optimizer thread, while the next iteration has
        started and offloads into a new buffer)."""
        offloaded, self.offloaded = self.offloaded, None
        segment, publishes = self.segment, self.publishes

        def publish() -> None:
            if offloaded is not None:
                offloaded.release()
            if publishes:
                segment.publish(iteration)
        return publish

    def finish_iteration(self, iteration: int) -> None:
        """At the end of an iteration: publish now, unless a correction will."""
        if self.pending_publish is not None:
            publish, self.pending_publish = self.pending_publish, None
            publish()
        elif self.correction is None:
            self.publish(iteration)

    def wait_for_correction(self) -> float:
        """Before this stage's parameters are used: its deferred correction must be done
        (other ranks wait for the segment's version instead). Returns the seconds waited
        (0 when it was already done); a failed correction raises here, never silently."""
        future, self.correction = self.correction, None
        if future is None:
            return 0.0
        t0 = time.perf_counter()
        waited = not future.done()
        future.result()
        return time.perf_counter() - t0 if waited else 0.0


class OwnedStages(Mapping[BackwardStage, BackwardStageOwner]):
    """The backward stages this rank owns (in the order of their optimizer groups)."""

    def __init__(self, owners: Mapping[BackwardStage, BackwardStageOwner]) -> None:
        self._owners = dict(owners)

    def __getitem__(self, b: BackwardStage) -> BackwardStageOwner:
        return self._owners[b]

    def __iter__(self) -> Iterator[BackwardStage]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)

    def start_iteration(self) -> None:
        for owner in self._owners.values():
            owner.start_iteration()

    def check_pending(self, optimizer: AsyncGroupOptimizer) -> None:
        """Submit the overflow check of every offloaded gradient not stepped yet."""
        for owner in self._owners.values():
            if owner.offloaded is not None and not owner.submitted:
                owner.check(optimizer)

    def correct_deferred(self, optimizer: AsyncGroupOptimizer, iteration: int) -> None:
        """Corrections (overflow rollbacks, clipping corrections) go on past the end of
        the iteration, one task per owned stage in the next iteration's forward order; each
        publishes its stage when done, so a forward waits only for its own stage's."""
        owners = [owner for _, owner in sorted(self._owners.items())]  # forward order
        publishers = [owner.publisher(iteration) for owner in owners]
        futures = optimizer.correct_deferred(
            [(owner.groups, publish) for owner, publish in zip(owners, publishers)])
        for owner, publish, future in zip(owners, publishers, futures):
            owner.correction = future
            owner.pending_publish = publish if future is None else None

    def finish_iteration(self, iteration: int) -> None:
        for owner in self._owners.values():
            owner.finish_iteration(iteration)

    @property
    def largest(self) -> int:
        """Elements of the largest owned stage (1 when none)."""
        return max((owner.numel for owner in self._owners.values()), default=1)
