"""The optimizer state file's layout: per group and version, [p | m | v], each part padded
to the I/O alignment; the host buffers that hold one group's version (the window, one per
class of groups, as large as the class's largest group) and the scratch buffer that
rollbacks, corrections and loads go through a chunk at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.optimizer.state_io import round_up
from megatron.schedules.memory_model import STATE_SCRATCH_CHUNK


@dataclass(frozen=True)
class GroupRegion:
    """Where one group's two versions lie in the file, and its parts' byte sizes."""

    numel: int
    offset: int  # of version 0; version 1 follows
    p_bytes: int
    s_bytes: int  # of m, and of v

    @property
    def version_bytes(self) -> int:
        return round_up(self.p_bytes) + 2 * round_up(self.s_bytes)

    def version_offset(self, version: int) -> int:
        return self.offset + version * self.version_bytes


def layout_regions(numels: Sequence[int], master_dtype: torch.dtype,
                   state_dtype: torch.dtype) -> list[GroupRegion]:
    regions, at = [], 0
    for n in numels:
        region = GroupRegion(n, at, n * master_dtype.itemsize, n * state_dtype.itemsize)
        regions.append(region)
        at += 2 * region.version_bytes
    return regions


def file_bytes(numels: Sequence[int], master_dtype: torch.dtype,
               state_dtype: torch.dtype) -> int:
    """The state file's size: both versions of every group."""
    regions = layout_regions(numels, master_dtype, state_dtype)
    return sum(2 * r.version_bytes for r in regions)


def buffer_sizes(regions: Sequence[GroupRegion], classes: Sequence[int]) -> dict[int, int]:
    """Per class of groups, the bytes of its largest group (the size of its buffers)."""
    sizes: dict[int, int] = {}
    for region, kind in zip(regions, classes):
        sizes[kind] = max(sizes.get(kind, 0), region.version_bytes)
    return sizes


def scratch_elements(numels: Sequence[int], chunk: int) -> int:
    """Elements the scratch buffer holds: a chunk, or the largest group when smaller."""
    return max(1, min(chunk, max(numels, default=1)))


def scratch_bytes(numels: Sequence[int], master_dtype: torch.dtype, state_dtype: torch.dtype,
                  chunk: int) -> int:
    """The scratch buffer's bytes: p, m and v of `scratch_elements`, each part padded."""
    n = scratch_elements(numels, chunk)
    return round_up(n * master_dtype.itemsize) + 2 * round_up(n * state_dtype.itemsize)


def window_bytes(numels: Sequence[int], master_dtype: torch.dtype, state_dtype: torch.dtype,
                 window: int, classes: Sequence[int] | None = None,
                 chunk: int = STATE_SCRATCH_CHUNK) -> int:
    """Host bytes of the window (`window` buffers per class of groups, each as large as the
    class's largest group) and of the scratch buffer (a chunk of `chunk` elements)."""
    regions = layout_regions(numels or [1], master_dtype, state_dtype)
    sizes = buffer_sizes(regions, classes or [0] * len(regions))
    return window * sum(sizes.values()) + scratch_bytes(numels, master_dtype, state_dtype, chunk)


def region_views(region: GroupRegion, buffer: torch.Tensor, master_dtype: torch.dtype,
                 state_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, m, v of a group inside `buffer` (laid out as one version in the file)."""
    at, out = 0, []
    for nbytes, dtype in ((region.p_bytes, master_dtype), (region.s_bytes, state_dtype),
                          (region.s_bytes, state_dtype)):
        out.append(buffer[at:at + nbytes].view(dtype))
        at += round_up(nbytes)
    return tuple(out)
