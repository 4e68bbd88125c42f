"""Data parallelism: where each process sits, and the host groups it talks over.

The world is `pipeline_size x data_parallel_size` processes laid out as megatron-core's
`parallel_state` orders them (tensor parallel size 1): data-parallel ranks vary fastest,
so global rank = data_parallel_rank + D * pipeline_rank. The D processes that play one
pipeline rank form a data-parallel group (they own the same backward stages and split
their optimizer state under ZeRO); the P processes of one replica form a pipeline group
(the schedule's ranks are its members, in order).

Host tensors travel over gloo groups created here (every process creates every group, in
the same order, as torch.distributed requires). Three are per process: the pipeline
group (loss and timings of one replica, p2p peers), the data-parallel group used by the
main thread (the end-of-iteration barrier, checkpoint gathers) and a second one over the
same ranks used only by the gradient-reduction thread, so that two threads never post on
one group (gloo matches collectives by posting order per group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron.pipeline.host_group import gloo_group


@dataclass(frozen=True)
class ParallelLayout:
    """One process's place in a `pipeline_size x data_parallel_size` world."""

    pipeline_size: int
    data_parallel_size: int
    rank: int  # global

    def __post_init__(self) -> None:
        if self.pipeline_size < 1 or self.data_parallel_size < 1:
            raise ValueError(f"pipeline_size={self.pipeline_size}, data_parallel_size="
                             f"{self.data_parallel_size}: expected positive sizes")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank}: expected 0 <= rank < {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size

    @property
    def pipeline_rank(self) -> int:
        return self.rank // self.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank % self.data_parallel_size

    def global_rank(self, pipeline_rank: int, data_parallel_rank: int | None = None) -> int:
        dp = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        return dp + self.data_parallel_size * pipeline_rank

    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this process's replica, indexed by pipeline (schedule) rank."""
        return [self.global_rank(p) for p in range(self.pipeline_size)]

    def data_parallel_ranks(self) -> list[int]:
        """Global ranks that play this process's pipeline rank, by data-parallel rank."""
        return [self.global_rank(self.pipeline_rank, d) for d in range(self.data_parallel_size)]

    def all_pipeline_groups(self) -> list[list[int]]:
        return [[d + self.data_parallel_size * p for p in range(self.pipeline_size)]
                for d in range(self.data_parallel_size)]

    def all_data_parallel_groups(self) -> list[list[int]]:
        return [[d + self.data_parallel_size * p for d in range(self.data_parallel_size)]
                for p in range(self.pipeline_size)]


def shard_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """Elements [lo, hi) of a flat run of `numel` that part `index` of `parts` holds:
    equal contiguous parts of ceil(numel / parts) (the last ones shorter or empty)."""
    size = -(-numel // parts)
    return min(numel, index * size), min(numel, (index + 1) * size)


@dataclass
class HostGroups:
    """The gloo groups of one process (None: the default group, when D = 1)."""

    pipeline: dist.ProcessGroup | None
    data_parallel: dist.ProcessGroup | None
    gradients: dist.ProcessGroup | None  # the gradient-reduction thread's only


def create_host_groups(layout: ParallelLayout, world: dist.ProcessGroup | None
                       ) -> HostGroups:
    """Collective: every process creates every group in the same order. With D = 1 the
    pipeline is the whole world (`world`, the existing host group) and no group is made."""
    if layout.data_parallel_size == 1:
        return HostGroups(world, None, None)
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, groups in (("pipeline", layout.all_pipeline_groups()),
                         ("data_parallel", layout.all_data_parallel_groups()),
                         ("gradients", layout.all_data_parallel_groups())):
        for ranks in groups:
            group = gloo_group(ranks)
            if layout.rank in ranks:
                mine[kind] = group
    return HostGroups(mine["pipeline"], mine["data_parallel"], mine["gradients"])
