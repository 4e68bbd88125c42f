"""This node's shared memory as the training loop sees it, before and while a pipeline runs.

The loop measures what is free and cleans up after dead runs before any segment exists,
names the two ways a node's shared memory ends a run, and compares what a process
page-locks with its limit; the segments themselves, their names and headers are the
offload layer's business, reached only through this module.
"""

from __future__ import annotations

import os

from megatron.common.units import format_bytes
from megatron.offload.host_pinning import PinningShortfall, memlock_limit, memlock_shortfall
from megatron.offload.naming import resolve_job_id, resolve_procs_per_node
from megatron.offload.param_store import job_segments, sweep_dead_segments
from megatron.offload.shm import SegmentInUseError
from megatron.offload.shm_header import read_header
from megatron.offload.shm_space import DEFAULT_SHM_DIR, ShmSpaceError, free_bytes

# the offload layer's names the loop uses, as they are
__all__ = ["DEFAULT_SHM_DIR", "PinningShortfall", "SegmentInUseError", "ShmSpaceError",
           "free_bytes", "live_job_with_this_id", "memlock_limit", "memlock_shortfall",
           "resolve_procs_per_node", "sweep_left_behind"]


def sweep_left_behind(shm_dir: str = DEFAULT_SHM_DIR) -> None:
    """Remove the segments of dead processes (any run id: a job whose workers and reapers
    were killed leaves them) and say how much, once per node."""
    names, nbytes = sweep_dead_segments(shm_dir)
    if names:
        print(f"removed {len(names)} shared-memory segment(s) ({format_bytes(nbytes)}) "
              f"left by dead processes from {shm_dir}", flush=True)


def live_job_with_this_id() -> SegmentInUseError | None:
    """Segments of this job id that survive the sweep belong to a live process: another
    job started with the same --rdzv-id. Found by each node's local rank 0 before any
    segment exists, so that the ranks stop together instead of each at its creation."""
    job_id = resolve_job_id()
    for name in job_segments(job_id):
        header = read_header(os.path.join(DEFAULT_SHM_DIR, name))
        if header is not None:
            return SegmentInUseError(
                f"shared-memory segment {DEFAULT_SHM_DIR}/{name} belongs to live process "
                f"{header['pid']}: another job with the same job id ({job_id}) is running "
                "on this node; give this job another --rdzv-id or stop the other one")
    return None
