"""The per-node parameter store: one shared-memory segment per backward stage (stage, sub).

The process that owns a backward stage creates its segment, fills it and publishes a
version after each optimizer step; the other local processes that run that stage's
forward or backward attach to the same memory and wait for the version they need.

    store = ParameterStore(job_id=None, rank=rank, procs_per_node=2)   # id from torchrun
    seg = store.create((3, 1), numel, torch.bfloat16)   # owner
    seg.write(initial_flat, version=0)
    other = store.attach((3, 1))                        # another local rank
    other.wait_version(iteration)                       # then use other.params (a view)
    store.close()                                       # owner: removes its segments

Cleanup: `close()` (also on `with` exit and at interpreter exit) removes the segments
this process created; a reaper process removes them if this process is killed; and a
new store sweeps every segment of this project whose creator is dead, whatever its job
(a job killed with its reapers leaves its segments, and the next run has another id).
"""

from __future__ import annotations

import atexit
import os
import weakref

import torch

from megatron.offload.naming import (
    SEGMENT_PREFIX,
    job_prefix,
    namespace,
    resolve_job_id,
    resolve_procs_per_node,
    segment_name,
)
from megatron.offload.shm import SharedSegment
from megatron.offload.shm_owner import remove_if_stale
from megatron.offload.shm_space import DEFAULT_SHM_DIR, check_space, segment_bytes
from megatron.schedules.instructions import BackwardStage
from megatron.schedules.replica_plan import node_of

_open_stores: weakref.WeakSet[ParameterStore] = weakref.WeakSet()


def _close_open_stores() -> None:
    for store in list(_open_stores):
        store.close()


atexit.register(_close_open_stores)


class ParameterStore:
    """Segments of one job on one (possibly simulated) node, keyed by (stage, sub)."""

    def __init__(
        self,
        job_id: str | None = None,
        rank: int | None = None,
        procs_per_node: int | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
    ) -> None:
        self.job_id = resolve_job_id(job_id)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.procs_per_node = resolve_procs_per_node(procs_per_node)
        self.node = node_of(self.rank, self.procs_per_node)
        self.shm_dir = shm_dir
        self.namespace = namespace(self.job_id, self.node)
        self._segments: dict[BackwardStage, SharedSegment] = {}
        self.swept, self.swept_bytes = sweep_dead_segments(shm_dir)
        _open_stores.add(self)

    def path(self, key: BackwardStage) -> str:
        return os.path.join(self.shm_dir, segment_name(self.job_id, self.node, *key))

    def check_capacity(self, sizes: dict[BackwardStage, tuple[int, torch.dtype]]) -> int:
        """Fail before anything is created when /dev/shm cannot hold all these segments."""
        required = sum(segment_bytes(numel, dtype) for numel, dtype in sizes.values())
        check_space(required, self.shm_dir, what=f"{len(sizes)} stage segments of node {self.node}")
        return required

    def create(self, key: BackwardStage, numel: int, dtype: torch.dtype) -> SharedSegment:
        """Create the segment of backward stage `key`; this process owns it."""
        if key in self._segments:
            raise ValueError(f"stage {key}: this process already holds its segment")
        segment = SharedSegment.create(self.path(key), numel, dtype, self.shm_dir)
        self._segments[key] = segment
        return segment

    def attach(
        self,
        key: BackwardStage,
        numel: int | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 60.0,
    ) -> SharedSegment:
        """Map the segment of `key` created by another local process (waits for it)."""
        if key in self._segments:
            return self._segments[key]
        segment = SharedSegment.attach(self.path(key), numel, dtype, timeout_s)
        self._segments[key] = segment
        return segment

    def get(self, key: BackwardStage) -> SharedSegment:
        try:
            return self._segments[key]
        except KeyError:
            raise KeyError(f"stage {key}: not created or attached in this process") from None

    def mapped_bytes(self) -> int:
        """The bytes of every segment this process maps, created or attached: what it
        page-locks on CUDA (host_pinning)."""
        return sum(segment_bytes(s.numel, s.dtype) for s in self._segments.values())

    def created(self) -> list[SharedSegment]:
        """The segments this process created (and removes on close)."""
        return [segment for segment in self._segments.values() if segment.owner]

    def release(self, key: BackwardStage) -> None:
        """Unmap `key`; if this process created it, remove it from /dev/shm."""
        segment = self._segments.pop(key, None)
        if segment is not None:
            segment.release()

    def close(self) -> None:
        for key in list(self._segments):
            self.release(key)
        _open_stores.discard(self)

    def __enter__(self) -> ParameterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def job_segments(job_id: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Names of every segment of a job in `shm_dir`, all nodes (for checks and tools)."""
    prefix = job_prefix(job_id)
    return sorted(name for name in os.listdir(shm_dir) if name.startswith(prefix))


def sweep_dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> tuple[list[str], int]:
    """Remove every segment of this project in `shm_dir` whose creator is dead, whatever
    its job id: (the names removed, their bytes). A live process's segment, or one whose
    header is not written yet, is left alone."""
    removed, nbytes = [], 0
    for name in sorted(os.listdir(shm_dir)):
        if name.startswith(SEGMENT_PREFIX):
            path = os.path.join(shm_dir, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if remove_if_stale(path):
                removed.append(name)
                nbytes += size
    return removed, nbytes
