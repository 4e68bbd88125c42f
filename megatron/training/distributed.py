"""Process-group setup: torchrun's environment when present, a one-process group otherwise.

megatron-core's tensor-parallel layers read their groups from parallel_state, so even a single
process initializes torch.distributed (world size 1) and the model-parallel groups (all size 1).
Backend: NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.host_group import forget_host_group


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Idempotent. Uses torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) when set."""
    backend = default_backend()
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        backend=dist.get_backend(),
    )


def shutdown_distributed() -> None:
    forget_host_group()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
