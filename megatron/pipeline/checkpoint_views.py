"""The owned stages' optimizer state seen as whole-model parameters, for checkpoint files.

With one replica, `views()` are live views of the master, exp_avg and exp_avg_sq inside
the CPU optimizer (no copy), by LlamaModel parameter name; a load fills them in place. With
data parallelism under ZeRO, every replica holds a shard of each stage, so `views()` are
full tensors gathered from the replicas' shards (the checkpoint writer keeps one copy of
tensors several ranks hold) and `restore` hands each replica its shard of what a load put
in them. With the states on NVMe, `views()` are views of the committed states in the
state file mapped into memory (read and written through the page cache), and `restore`
makes what a load put in them durable.

A parameter lies in one of its stage's two optimizer groups (decayed elements first, then
the others).

Each view is handed out with a storage of its own size over the same memory
(`own_storage`): torch.distributed.checkpoint's writer clones a tensor whose storage is
larger than it and keeps every tensor of a file until the file is closed, so views of the
flat groups cost a second copy of the states at every synchronous save.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.pipeline.owner import OwnedStages
from megatron.pipeline.stage_modules import StageModule
from megatron.schedules.instructions import BackwardStage

Views = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class CheckpointViews:
    def __init__(self, owned: OwnedStages, modules: dict[BackwardStage, StageModule],
                 adam: CPUAdamW, zero_stage: int, replicas: int,
                 data_parallel: dist.ProcessGroup | None) -> None:
        self.owned, self.modules, self.adam = owned, modules, adam
        self.zero_stage, self.replicas, self.data_parallel = zero_stage, replicas, data_parallel
        self._gathered: dict[BackwardStage, tuple[torch.Tensor, ...]] = {}
        self._copies: dict[int, tuple[torch.Tensor, ...]] = {}  # states on disk, by group

    def views(self) -> Views:
        """Every owned parameter's (master, exp_avg, exp_avg_sq), fp32 or bf16 as the
        optimizer keeps them. master()/exp_avg() bring subgroups kept on the device back to
        the host; the caller has finished the deferred corrections first."""
        return {name: tuple(own_storage(t) for t in triple)
                for name, triple in self._views().items()}

    def _views(self) -> Views:
        self._copies = {}
        if self.replicas > 1:
            return self._gathered_views()
        out = {}
        for b, owner in self.owned.items():
            module = self.modules[b]
            for s, name in zip(module.layout.slices, module.model_names()):
                group, offset = ((owner.groups[0], s.offset) if s.offset < owner.split
                                 else (owner.groups[1], s.offset - owner.split))
                out[name] = tuple(buf[offset:offset + s.numel].view(s.shape)
                                  for buf in self._group_states(group))
        return out

    def _group_states(self, group: int) -> tuple[torch.Tensor, ...]:
        """The group's p, m, v: the optimizer's live buffers, or (on disk) the mapped
        committed state, kept until the next views() so that a load reaches restore()."""
        if self.adam.disk is None:
            return self.adam.states(group)
        if group not in self._copies:
            self._copies[group] = self.adam.states(group)
        return self._copies[group]

    def _stepped_groups(self) -> list[int]:
        """Groups that hold elements (an empty group is a placeholder that never steps)."""
        return [g for owner in self.owned.values() for g in owner.live_groups()]

    def optimizer_step(self) -> int:
        """Adam's step count (every group steps together; skipped iterations do not count)."""
        return max((self.adam.step_count(g) for g in self._stepped_groups()), default=0)

    def restore(self, optimizer_step: int) -> None:
        """After a checkpoint load overwrote `views()` in place: each replica takes its
        shard of the loaded tensors, and every group continues at `optimizer_step`."""
        adam, stepped = self.adam, set(self._stepped_groups())
        if self.replicas > 1:
            self._scatter_gathered()
        states = [self._group_states(g) for g in range(adam.num_groups)]
        adam.load_state_dict({"groups": [
            {"master": p, "exp_avg": m, "exp_avg_sq": v,
             "step": optimizer_step if g in stepped else 0}
            for g, (p, m, v) in enumerate(states)]})
        self._copies = {}

    def _gathered_views(self) -> Views:
        """Every replica gathers the full master, exp_avg and exp_avg_sq of its stages from
        the shards (collective over the data-parallel group)."""
        self._gathered, out = {}, {}
        for b, owner in self.owned.items():
            full = []
            for part in owner.state(self.adam):
                if self.zero_stage == 0:
                    full.append(part.clone())
                    continue
                size = -(-owner.numel // self.replicas)
                send = torch.zeros(size, dtype=part.dtype)  # saved in the run's precision
                send[:part.numel()] = part
                recv = torch.empty(size * self.replicas, dtype=part.dtype)
                dist.all_gather_into_tensor(recv, send, group=self.data_parallel)
                full.append(recv[:owner.numel])
            self._gathered[b] = tuple(full)
            module = self.modules[b]
            for s, name in zip(module.layout.slices, module.model_names()):
                out[name] = tuple(t[s.offset:s.offset + s.numel].view(s.shape) for t in full)
        return out

    def _scatter_gathered(self) -> None:
        """After a load filled the gathered tensors: copy this process's shard back."""
        for b, owner in self.owned.items():
            full = self._gathered[b]
            for group, (lo, hi) in zip(owner.groups, owner.bounds()):
                if hi > lo:
                    for own, tensor in zip(self._group_states(group), full):
                        own.copy_(tensor[lo:hi])
        self._gathered = {}


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` (contiguous) as a tensor whose storage is exactly its bytes, on the same
    memory: writes go through, no copy. The storage keeps the memory's owner alive."""
    if view.numel() == 0 or view.untyped_storage().nbytes() == view.nbytes:
        return view
    memory = (ctypes.c_char * view.nbytes).from_address(view.data_ptr())
    memory.owner = view  # the storage holds `memory`, which holds the view's storage
    return torch.frombuffer(memory, dtype=view.dtype).view(view.shape)
