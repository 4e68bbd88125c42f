"""The model pieces of each backward stage (i, k), and their flat parameter layout.

Backward stage (i, k) covers the decoder layers that `sub_stage_layers` gives it, plus the
embedding for (0, 0) and the head for (S-1, d-1). A forward stage is its d backward stages
run in order. Each process builds the modules of the stages it runs, nothing else.

The flat layout puts the parameters that take weight decay first and the 1-D ones (norm
weights) after them, so the CPU optimizer can treat each as one contiguous group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megatron.models.llama import LlamaConfig, build_pieces, run_pieces, uses_weight_decay
from megatron.offload.layout import FlatLayout, ParamSlice
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
) -> dict[BackwardStage, StageModule]:
    """Modules of the backward stages `keys`, initialized in fp32 (the masters' values),
    with layouts in the training dtype `dtype`."""
    indices = model_piece_indices(partition, backward_split, cfg.num_layers)
    fp32 = cfg.with_dtype(torch.float32)
    out = {}
    for key in sorted(set(keys)):
        module = build_pieces(fp32, indices[key])
        layout, decay_numel = decay_first_layout(module, dtype)
        out[key] = StageModule(key, module, layout, decay_numel, tuple(indices[key]))
    return out


def _model_name(local: str, model_pieces: tuple[int, ...]) -> str:
    position, rest = local.split(".", 1)
    return f"pieces.{model_pieces[int(position)]}.{rest}"
