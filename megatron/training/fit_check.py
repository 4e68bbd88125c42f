"""Refuse a pipeline run that will not fit, before any segment, buffer or module exists.

The memory model (megatron/schedules/memory_model.py) says what this rank's node needs
in /dev/shm and host memory and what this rank needs on its GPU; this module compares that
with what is free right now. Every rank checks, then one all-reduce makes every rank stop
together (a rank that went on would wait forever for the others' segments).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.models.llama import LlamaConfig
from megatron.models.presets import ModelPreset
from megatron.offload.naming import resolve_procs_per_node
from megatron.offload.shm_space import DEFAULT_SHM_DIR, free_bytes
from megatron.optimizer.rounding import state_bytes_per_param
from megatron.pipeline.config import PipelineConfig
from megatron.schedules.memory_model import GPU_TERMS, MemoryPlan, plan_memory
from megatron.schedules.replica_plan import node_of
from megatron.training.arguments import ArgumentError

GIB = 2**30


class ResourceError(ArgumentError):
    """A resource the run needs more of than there is: one line, exit status 2."""

    def __init__(self, resource: str, message: str) -> None:
        super().__init__(resource, "", message)
        self.message = f"{resource}: {message}"

    def __str__(self) -> str:
        return self.message


def host_memory_available() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping)."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def run_memory_plan(config: PipelineConfig, model_cfg: LlamaConfig, on_cuda: bool) -> MemoryPlan:
    model = ModelPreset("run", model_cfg.num_layers, model_cfg.hidden_size,
                        model_cfg.ffn_hidden_size, model_cfg.num_attention_heads,
                        model_cfg.num_query_groups, model_cfg.seq_length, model_cfg.vocab_size)
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    # Gradients go to the host in fp32 on CUDA, in the working dtype on the CPU layer.
    grad_host = 4 if on_cuda else itemsize
    procs = resolve_procs_per_node(config.procs_per_node)
    sub = config.subgroups
    return plan_memory(config.schedule, model, config.micro_batch_size, model_cfg.seq_length,
                       itemsize, grad_host, procs_per_node=procs,
                       subgroup_stride=0 if sub is None else sub.stride,
                       subgroup_size=None if sub is None else sub.size,
                       resident_fraction=0.0 if sub is None else sub.resident_fraction,
                       optimizer_bytes=state_bytes_per_param(config.optimizer.master_dtype,
                                                             config.optimizer.state_dtype))


def first_shortfall(plan: MemoryPlan, rank: int, on_cuda: bool, shm_dir: str = DEFAULT_SHM_DIR,
                    itemsize: int = 2) -> ResourceError | None:
    """What this rank's node or GPU lacks now, as the error to raise (None: it fits)."""
    node = node_of(rank, plan.procs_per_node)
    needs = plan.per_node[node]
    shm_free = free_bytes(shm_dir)
    what = "16-bit parameters" if itemsize == 2 else "parameters (fp32)"
    if needs["shm_parameters"] > shm_free:
        return ResourceError(shm_dir, f"the {what} of this node's stages need "
                             f"{needs['shm_parameters'] / GIB:.1f} GiB, {shm_free / GIB:.1f} GiB "
                             "free: give Docker --shm-size or use more nodes")
    host = needs["shm_parameters"] + needs["optimizer_states"] + needs["host_gradients"]
    if not on_cuda:  # the CPU device layer's "device memory" is host memory too
        ranks = [r for r in range(len(plan.per_gpu)) if node_of(r, plan.procs_per_node) == node]
        host += sum(plan.gpu_total(r) for r in ranks)
    available = host_memory_available()
    if host > available:
        return ResourceError("host memory", f"this node's optimizer states, gradients and "
                             f"parameters need {host / GIB:.1f} GiB, {available / GIB:.1f} GiB "
                             "available: use more nodes")
    if on_cuda:
        free, _ = torch.cuda.mem_get_info()
        need = plan.gpu_total(rank)
        if need > free:
            parts = ", ".join(f"{t.replace('_', ' ')} {plan.per_gpu[rank][t] / GIB:.1f}"
                              for t in GPU_TERMS)
            return ResourceError("gpu memory", f"rank {rank} needs {need / GIB:.1f} GiB ({parts}), "
                                 f"{free / GIB:.1f} GiB free: use a smaller --micro-batch-size, "
                                 "more --forward-stages or more nodes (see --plan)")
    return None


def refuse_what_does_not_fit(config: PipelineConfig, model_cfg: LlamaConfig, rank: int,
                             group: dist.ProcessGroup | None) -> None:
    """Raise ResourceError on every rank when any rank's node or GPU lacks memory."""
    on_cuda = torch.cuda.is_available()
    plan = run_memory_plan(config, model_cfg, on_cuda)
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    error = first_shortfall(plan, rank, on_cuda, itemsize=itemsize)
    if config.ranks > 1 and dist.is_initialized():
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, group=group)
        if flag.item() and error is None:
            error = ResourceError("memory", "another rank's node or GPU cannot fit this run")
    if error is not None:
        raise error
