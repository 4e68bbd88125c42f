"""Will this run fit this machine now: the memory model of the run about to start (its
RunPlan's, run_plan.py), against what its node and device have free (measured by the
caller), as the error to raise; and what the device has beyond it (`device_headroom`).

The trainer calls it before any segment, buffer or module exists (training/fit_check.py
measures and agrees across ranks); --plan asks the same model about a hardware profile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.common.units import format_bytes, format_shortfall
from megatron.config.errors import ConfigError
from megatron.config.model import ModelConfig
from megatron.config.placement import Placement
from megatron.config.run import RunConfig
from megatron.schedules.hardware import HardwareProfile
from megatron.schedules.instructions import Schedule
from megatron.schedules.memory_model import (
    GPU_TERMS,
    MemoryPlan,
    MemoryShape,
    plan_memory,
    single_process_memory,
)
from megatron.schedules.replica_plan import node_of
from megatron.schedules.validator import ValidationReport


class ResourceError(ConfigError):
    """A resource the run needs more of than there is: one line, exit status 2."""

    def __init__(self, resource: str, message: str) -> None:
        super().__init__(resource, "", message)
        self.message = f"{resource}: {message}"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class FreeMemory:
    """What this rank's node and device have free now, in bytes."""

    shm: int  # in the shared-memory file system (`shm_dir`)
    host: int  # MemAvailable
    device: int | None  # the GPU's free memory; on the CPU layer its capacity, or None
    shm_dir: str = "/dev/shm"
    # the CPU device layer: its device memory is host memory (counted in the host's need)
    device_in_host: bool = False

    def __post_init__(self) -> None:
        if self.device is None and not self.device_in_host:  # no device figure: the CPU layer
            object.__setattr__(self, "device_in_host", True)


@dataclass(frozen=True)
class PlannedShape:
    """What planning varies of a run when it asks the memory model: the rest (working and
    host-gradient precision, sequence) is the run's."""

    model: ModelConfig
    micro_batch_size: int
    procs_per_node: int
    on_cuda: bool
    placement: Placement  # where the optimizer's updates run and its states live
    optimizer_bytes: int  # host bytes per parameter of the master and Adam's moments
    hardware: HardwareProfile | None = None  # the profile's device-update rates, if any


def memory_plan(run: RunConfig, schedule: Schedule, shape: PlannedShape,
                report: ValidationReport) -> MemoryPlan:
    """The one place planning asks the memory model (`plan_memory`) about `schedule`
    (`report`: its validation, done once where it was built)."""
    p = run.precision
    return plan_memory(schedule, MemoryShape(
        shape.model, shape.micro_batch_size, run.model.seq_length, p.working_bytes,
        p.host_gradient_bytes, shape.optimizer_bytes, shape.procs_per_node,
        state_snapshots(run, shape.placement), sends_complete=shape.on_cuda),
        shape.placement, shape.hardware, report)


def state_snapshots(run: RunConfig, placement: Placement) -> int:
    """Copies of the optimizer states the run keeps in host memory beside them: the step
    snapshot of --optimizer-exact-rollback (none on NVMe, where the file keeps the
    committed version) and the snapshot --async-save writes from."""
    exact = run.cpu_optimizer.optimizer_exact_rollback and not placement.states.on_nvme
    saving = run.checkpointing.async_save and run.checkpointing.save is not None
    return int(exact) + int(saving)


def device_headroom(plan: MemoryPlan, pipeline_rank: int, free: FreeMemory) -> int:
    """The device bytes this rank has free beyond its plan: its GPU's; on the CPU device
    layer, whose device memory is host memory, its share of what the node's host memory
    keeps free beyond the node's plan, and no more than its capacity leaves (when
    MEGATRON_CPU_DEVICE_MEMORY bounds it)."""
    device = None if free.device is None else max(0, free.device - plan.gpu_total(pipeline_rank))
    if not free.device_in_host:
        return device
    ranks = _ranks_on_node(plan, pipeline_rank)
    host = max(0, free.host - _host_need(plan, pipeline_rank, cpu_device=True)) // len(ranks)
    return host if device is None else min(device, host)


def _ranks_on_node(plan: MemoryPlan, pipeline_rank: int) -> list[int]:
    node = node_of(pipeline_rank, plan.procs_per_node)
    return [r for r in range(len(plan.per_gpu)) if node_of(r, plan.procs_per_node) == node]


def _host_need(plan: MemoryPlan, pipeline_rank: int, cpu_device: bool) -> int:
    """Host bytes the rank's node needs: parameters, optimizer states, host gradients and,
    on the CPU device layer, every local rank's device memory."""
    needs = plan.per_node[node_of(pipeline_rank, plan.procs_per_node)]
    host = needs["shm_parameters"] + needs["optimizer_states"] + needs["host_gradients"]
    if cpu_device:
        host += sum(plan.gpu_total(r) for r in _ranks_on_node(plan, pipeline_rank))
    return host


def first_shortfall(plan: MemoryPlan, pipeline_rank: int, free: FreeMemory,
                    itemsize: int) -> ResourceError | None:
    """What this rank's node or device lacks, as the error to raise (None: it fits)."""
    node = node_of(pipeline_rank, plan.procs_per_node)
    needs = plan.per_node[node]
    what = "16-bit parameters" if itemsize == 2 else "parameters (fp32)"
    if needs["shm_parameters"] > free.shm:
        return ResourceError(free.shm_dir, f"the {what} of this node's stages "
                             f"would {format_shortfall(needs['shm_parameters'], free.shm)}: give "
                             "Docker --shm-size or use more nodes")
    # the CPU device layer's "device memory" is host memory too
    host = _host_need(plan, pipeline_rank, cpu_device=free.device_in_host)
    if host > free.host:
        return ResourceError("host memory", f"this node's optimizer states, gradients and "
                             f"parameters would {format_shortfall(host, free.host, 'available')}: "
                             "use more nodes")
    if free.device is not None:
        need = plan.gpu_total(pipeline_rank)
        if need > free.device:
            parts = ", ".join(f"{t.replace('_', ' ')} "
                              f"{format_bytes(plan.per_gpu[pipeline_rank][t])}"
                              for t in GPU_TERMS)
            where = ("CPU device memory (MEGATRON_CPU_DEVICE_MEMORY)" if free.device_in_host
                     else "gpu memory")
            return ResourceError(where, f"rank {pipeline_rank} would "
                                 f"{format_shortfall(need, free.device)} ({parts}): use a "
                                 "smaller --micro-batch-size, more --forward-stages or more "
                                 "nodes (see --plan)")
    return None


def single_process_shortfall(run: RunConfig, vocab_size: int, free: int,
                             where: str = "host memory") -> ResourceError | None:
    """The one-process run (the whole model, torch's AdamW, no recompute) against the
    memory available now on its device (`where`: "host memory" on the CPU device layer,
    "GPU memory" on CUDA), as the error to raise (None: it fits)."""
    terms = single_process_memory(replace(run.model, vocab_size=vocab_size),
                                  run.training.micro_batch_size, run.model.seq_length,
                                  run.precision.working_bytes)
    need = sum(terms.values())
    if need <= free:
        return None
    model_states = terms["parameters"] + terms["gradients"] + terms["optimizer_states"]
    parts = ", ".join(f"{t.replace('_', ' ')} {format_bytes(b)}" for t, b in terms.items())
    advice = ("a smaller model (--num-layers, --hidden-size, --vocab-size) or a pipeline over "
              "more processes (torchrun)" if model_states >= need - model_states
              else "a smaller --micro-batch-size or --seq-length")
    return ResourceError(where, f"the one-process run would "
                         f"{format_shortfall(need, free, 'available')} ({parts}): use "
                         f"{advice}")
