"""ZeRO over the host optimizer: the gradient reduction of each backward stage across its
data-parallel group, as soon as the stage's gradients are offloaded.

The D processes that play one pipeline rank own the same backward stages. Each keeps
(stage 1 and 2) the fp32 master, m and v of its 1/D of every owned stage's flat elements
(`shard_range`) and steps only that; its updated 16-bit shard goes straight into the
node's shared-memory segment, which the D processes map together (they sit on one node),
so the all-gather of the working parameters is the segment itself.

What differs between the stages is the reduction of the summed gradient (each replica's
backward already divides by the D replicas):

- stage 0: all-reduce; every process steps the whole stage (one of them writes the
  segment);
- stage 1: all-reduce; every process steps its shard of the reduced gradient;
- stage 2: reduce-scatter; each process receives only its shard (1/D of the bytes).

The reduction runs on the host, on the gloo group of the data-parallel ranks, because the
gradients are offloaded anyway: the device-to-host copy moves the whole stage once, and
the reduction then needs no device memory. It runs on one thread of its own, which takes
the stages in the order their OFFLOAD_GRAD instructions come: every process of the group
runs the same program, so the collectives are posted in one order on all of them, as
NCCL requires. The stage's optimizer tasks wait for the reduction's future.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.offload.grad_offload import GradientsReady
from megatron.offload.shm import SharedSegment
from megatron.pipeline.data_parallel import shard_range
from megatron.schedules.instructions import BackwardStage

ZERO_STAGES = (0, 1, 2)


@dataclass
class ReducedGradient:
    """A backward stage's gradient summed over the data-parallel group: `base` holds
    elements [offset, offset + base.numel()) of the stage once `ready` is done."""

    ready: Future
    base: torch.Tensor
    offset: int

    def slice(self, lo: int, hi: int) -> torch.Tensor:
        return self.base[lo - self.offset:hi - self.offset]


class GradientReducer:
    """Reduces each offloaded stage gradient over `group` on one background thread."""

    def __init__(self, zero_stage: int, parts: int, index: int,
                 group: dist.ProcessGroup | None,
                 thread_setup: Callable[[], None] | None = None) -> None:
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={zero_stage}: expected one of {ZERO_STAGES}")
        self.zero_stage, self.parts, self.index, self.group = zero_stage, parts, index, group
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-reduce",
                                          initializer=thread_setup)
        # Stage 2: per stage, the padded send buffer (when the stage does not divide into
        # equal parts) and this process's receive buffer, kept across iterations.
        self._buffers: dict[BackwardStage, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def shard(self, numel: int) -> tuple[int, int]:
        """The elements of a stage of `numel` this process steps."""
        if self.zero_stage == 0:
            return 0, numel
        return shard_range(numel, self.parts, self.index)

    @property
    def nbytes(self) -> int:
        """Host memory of the stage-2 buffers."""
        return sum(t.nbytes for pair in self._buffers.values() for t in pair if t is not None)

    def reduce(self, key: BackwardStage, offloaded: GradientsReady) -> ReducedGradient:
        """Queue the reduction of `offloaded` (it starts once the copy has landed)."""
        host = offloaded.host
        if self.zero_stage < 2:
            def all_reduce() -> None:
                offloaded.wait()
                dist.all_reduce(host, group=self.group)
            return ReducedGradient(self._thread.submit(all_reduce), host, 0)
        padded, out = self._stage2_buffers(key, host)
        lo, _ = shard_range(host.numel(), self.parts, self.index)

        def reduce_scatter() -> None:
            offloaded.wait()
            send = host
            if padded is not None:
                padded[:host.numel()].copy_(host)
                send = padded
            dist.reduce_scatter_tensor(out, send, group=self.group)
        return ReducedGradient(self._thread.submit(reduce_scatter), out, lo)

    def _stage2_buffers(self, key: BackwardStage, host: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if key not in self._buffers:
            size = -(-host.numel() // self.parts)
            padded = None
            if size * self.parts != host.numel():
                padded = torch.zeros(size * self.parts, dtype=host.dtype)
            self._buffers[key] = (padded, torch.empty(size, dtype=host.dtype))
        return self._buffers[key]

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def publish_shards(segments: Iterable[SharedSegment], iteration: int,
                   group: dist.ProcessGroup | None, first: bool,
                   republish: bool = False) -> None:
    """The replicas of a pipeline rank wrote their shards of its stages into the node's
    `segments`: once all are in (a barrier of the data-parallel group), the first replica
    publishes each one's version."""
    dist.barrier(group=group)
    if first:
        for segment in segments:
            segment.publish(iteration, republish)
