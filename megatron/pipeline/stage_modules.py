"""The model pieces of each backward stage (i, k), and their flat parameter layout.

Backward stage (i, k) covers the decoder layers that `sub_stage_layers` gives it, plus the
embedding for (0, 0) and the head for (S-1, d-1). A forward stage is its d backward stages
run in order. Each process builds the modules of the stages it runs, nothing else.

The flat layout puts the parameters that take weight decay first and the 1-D ones (norm
weights) after them, so the CPU optimizer can treat each as one contiguous group.

A pipeline needs a stage's initial weights once, in its owner, to fill the master: it builds
its modules uninitialized (their parameters are pointed at the device slots before any use)
and `initial_parameters` builds one owned stage's pieces initialized at a time, so that the
start-up never holds a second copy of more than one stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from megatron.models.llama import LlamaConfig, build_pieces, run_pieces, uses_weight_decay
from megatron.offload.layout import FlatLayout, ParamSlice, copy_parameters_into
from megatron.schedules.instructions import BackwardStage
from megatron.schedules.partition import sub_stage_layers


def model_piece_indices(
    partition: tuple[int, ...], backward_split: int, num_layers: int
) -> dict[BackwardStage, list[int]]:
    """{(i, k): indices into the model's piece list (0 = embedding, L+1 = head)}."""
    out: dict[BackwardStage, list[int]] = {}
    for key, r in sub_stage_layers(partition, backward_split).items():
        indices = [0] if r.has_embedding else []
        indices += [1 + layer for layer in range(r.first, r.stop)]
        if r.has_head:
            indices.append(num_layers + 1)
        out[key] = indices
    return out


@dataclass
class StageModule:
    """One backward stage's pieces, its layout and how many elements take weight decay."""

    key: BackwardStage
    module: nn.ModuleList
    layout: FlatLayout
    decay_numel: int  # layout elements [0, decay_numel) take weight decay, the rest not
    model_pieces: tuple[int, ...]  # indices into the whole model's piece list

    def model_names(self) -> list[str]:
        """Each layout slice's name in the whole model (LlamaModel's parameter names)."""
        return [_model_name(s.name, self.model_pieces) for s in self.layout.slices]

    @property
    def has_embedding(self) -> bool:
        return self.key == (0, 0)

    def __call__(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        return run_pieces(self.module, hidden, batch)


def decay_first_layout(module: nn.Module, dtype: torch.dtype) -> tuple[FlatLayout, int]:
    """Layout in `dtype` (the working copy's), decayed parameters first."""
    params = list(module.named_parameters())
    ordered = [np for np in params if uses_weight_decay(*np)]
    decay_numel = sum(p.numel() for _, p in ordered)
    ordered += [np for np in params if not uses_weight_decay(*np)]
    slices, offset = [], 0
    for name, p in ordered:
        slices.append(ParamSlice(name, tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return FlatLayout(tuple(slices), offset, dtype), decay_numel


def build_stage_modules(
    cfg: LlamaConfig,
    partition: tuple[int, ...],
    backward_split: int,
    keys: Iterable[BackwardStage],
    dtype: torch.dtype,
    initialize: bool = True,
) -> dict[BackwardStage, StageModule]:
    """Modules of the backward stages `keys`, in fp32 (initialized: the masters' values;
    `initialize=False`: allocated, never written), with layouts in the training dtype
    `dtype`."""
    indices = model_piece_indices(partition, backward_split, cfg.num_layers)
    fp32 = cfg.with_dtype(torch.float32)
    out = {}
    for key in sorted(set(keys)):
        module = build_pieces(fp32, indices[key], initialize)
        layout, decay_numel = decay_first_layout(module, dtype)
        out[key] = StageModule(key, module, layout, decay_numel, tuple(indices[key]))
    return out


def initial_parameters(cfg: LlamaConfig, stage: StageModule) -> torch.Tensor:
    """The stage's initial weights, flat in its layout's order, in fp32: its pieces built
    initialized (each from its own seed), copied out and dropped."""
    pieces = build_pieces(cfg.with_dtype(torch.float32), stage.model_pieces)
    flat = torch.empty(stage.layout.numel, dtype=torch.float32)
    copy_parameters_into(pieces, replace(stage.layout, dtype=torch.float32), flat)
    return flat


def drop_parameters(stage: StageModule, device: torch.device) -> None:
    """Point the stage's parameters at nothing: from now on they are views of the device
    slots (bound before each use), and their construction memory goes back."""
    for param in stage.module.parameters():
        param.data = torch.empty(0, dtype=stage.layout.dtype, device=device)


def _model_name(local: str, model_pieces: tuple[int, ...]) -> str:
    position, rest = local.split(".", 1)
    return f"pieces.{model_pieces[int(position)]}.{rest}"
