"""Refuse a run (a pipeline, or one process) that will not fit, before any segment, buffer or module exists.

The memory model says what this rank's node needs in /dev/shm and host memory and what
this rank needs on its GPU (megatron/planning/fit.py); this module measures what is free
right now. Every rank checks, then one all-reduce makes every rank stop together (a rank
that went on would wait forever for the others' segments).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.common.meminfo import available_host_memory
from megatron.config.device_choice import DeviceChoice, cpu_device_capacity
from megatron.config.run import RunConfig
from megatron.pipeline.host_group import host_group
from megatron.pipeline.node_memory import DEFAULT_SHM_DIR, free_bytes
from megatron.planning.fit import (
    FreeMemory,
    ResourceError,
    device_headroom,
    first_shortfall,
    single_process_shortfall,
)
from megatron.schedules.memory_model import MemoryPlan


def free_memory(shm_dir: str = DEFAULT_SHM_DIR) -> FreeMemory:
    """What this process's node and device have free now: on the CPU device layer its
    capacity when MEGATRON_CPU_DEVICE_MEMORY bounds it (the layer holds nothing before the
    pipeline exists, DeviceLayer.mem_get_info), else no device figure."""
    host = available_host_memory()
    if host is None:
        raise OSError("no MemAvailable in /proc/meminfo")
    if torch.cuda.is_available():
        return FreeMemory(free_bytes(shm_dir), host, torch.cuda.mem_get_info()[0], shm_dir)
    return FreeMemory(free_bytes(shm_dir), host, cpu_device_capacity(), shm_dir,
                      device_in_host=True)


def refuse_what_does_not_fit(memory: MemoryPlan, run: RunConfig, pipeline_rank: int,
                             free: FreeMemory, found: Exception | None = None) -> int | None:
    """Raise ResourceError on every rank when any rank's node or GPU lacks what `memory`
    (the start of the run's plan) needs of `free` (free_memory, measured now); `found`:
    another reason this rank cannot start (raised here, the others stop with it). Returns
    the device bytes this rank has free beyond the plan (device_headroom): what
    --optimizer-gpu-stride auto's subgroups may take."""
    error = found or first_shortfall(memory, pipeline_rank, free, run.precision.working_bytes)
    if len(memory.per_gpu) * run.data_parallel_size > 1 and dist.is_initialized():
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, group=host_group())
        if flag.item() and error is None:
            error = ResourceError("memory", "another rank cannot start this run (its node or "
                                  "GPU lacks memory, or its node runs a job with this id)")
    if error is not None:
        raise error
    return device_headroom(memory, pipeline_rank, free)


def refuse_single_process_that_does_not_fit(run: RunConfig, vocab_size: int,
                                            device: DeviceChoice) -> None:
    """Raise ResourceError when the one-process run needs more memory than its device has
    free now (the model, its optimizer and one micro-batch's activations): the GPU's on
    CUDA, the host's on the CPU device layer (its capacity, where
    MEGATRON_CPU_DEVICE_MEMORY gives one)."""
    replicas_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.kind == "cuda":
        free = torch.cuda.mem_get_info(device.index)[0]
        # ranks sharing a GPU (--share-gpu) share its memory
        sharing = replicas_here if device.shared_gpu else 1
        where = "GPU memory"
    elif (capacity := cpu_device_capacity()) is not None:  # each process's own, as a GPU
        free, sharing, where = capacity, 1, "CPU device memory (MEGATRON_CPU_DEVICE_MEMORY)"
    else:
        free = available_host_memory()
        if free is None:
            return  # nothing to measure against (not Linux): the run finds out itself
        # data-parallel replicas of the whole model (--pipeline-model-parallel-size 1)
        # share their node's memory: each gets its share
        sharing, where = replicas_here, "host memory"
    error = single_process_shortfall(run, vocab_size, free // max(sharing, 1), where)
    if error is not None:
        raise error
