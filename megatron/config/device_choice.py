"""Which device a process trains on and how the processes talk: decided once, at start.

One decision for both step paths (the one-process model and the pipeline) and for every
tool that builds a model: the device kind and index, the process-group backend, and
whether point-to-point transfers are staged through host memory. It is pure data, made
from what the machine reports (CUDA's availability and GPU count) and the launcher's
environment, so a test can make the CUDA decision on a machine without a GPU. Applying it
(set_device, the process group, megatron-core's RNG tracker) is
`megatron.training.distributed.initialize_distributed`'s job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.common.units import BYTES_EXPECTED, parse_bytes
from megatron.config.errors import ConfigError

CPU_DEVICE_MEMORY_ENV = "MEGATRON_CPU_DEVICE_MEMORY"  # the CPU layer's device memory capacity


def cpu_device_capacity() -> int | None:
    """The CPU device layer's device memory capacity in bytes (MEGATRON_CPU_DEVICE_MEMORY),
    None when unset (unbounded); a bad value is a ConfigError (one line, exit status 2)."""
    text = os.environ.get(CPU_DEVICE_MEMORY_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError:
        raise ConfigError(CPU_DEVICE_MEMORY_ENV, repr(text),
                          f"expected {BYTES_EXPECTED}: the CPU device layer's device "
                          "memory") from None


@dataclass(frozen=True)
class DeviceChoice:
    kind: str  # "cuda" or "cpu" (the CPU device layer: each process plays one GPU)
    index: int  # the CUDA device this process uses (0 on the CPU)
    backend: str  # "nccl" or "gloo"
    shared_gpu: bool = False  # several ranks on one GPU (--share-gpu, a test mode)

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"

    @property
    def stages_transfers_through_host(self) -> bool:
        """gloo moves no device tensor between ranks: a CUDA rank on gloo copies each
        point-to-point transfer through a pinned host buffer."""
        return self.kind == "cuda" and self.backend == "gloo"


def choose_device(cuda_available: bool, gpu_count: int, local_rank: int,
                  local_world_size: int, share_gpu: bool = False) -> DeviceChoice:
    """One GPU per process on CUDA (NCCL); with `share_gpu`, every local rank on GPU
    `local_rank % gpu_count` over gloo. Without CUDA, the CPU device layer over gloo.

    More processes on a node than it has GPUs is refused (exit 2), before anything is
    allocated: two ranks on one GPU under NCCL fail at the first collective, or worse,
    with `invalid device ordinal` at set_device.
    """
    if not cuda_available or gpu_count < 1:
        return DeviceChoice("cpu", 0, "gloo")
    if share_gpu:
        return DeviceChoice("cuda", local_rank % gpu_count, "gloo", shared_gpu=True)
    if local_world_size > gpu_count:
        raise ConfigError(
            "--nproc-per-node", local_world_size,
            f"at most {gpu_count} (this node has {gpu_count} GPU"
            f"{'s' if gpu_count > 1 else ''}, one process each); --share-gpu lets the ranks "
            "share the GPUs over gloo, a test mode")
    return DeviceChoice("cuda", local_rank, "nccl")
