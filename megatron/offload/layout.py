"""Flat-parameter layout: a module's parameters as views of one flat buffer.

The store, the device double buffer, the gradient buffer and the CPU optimizer all work
on flat buffers. `FlatLayout` records where each parameter lives in such a buffer;
`bind_parameters` points every parameter at a flat buffer (no allocation: `.data` becomes
a view), `bind_gradients` makes `.grad` views of a flat gradient buffer so autograd
accumulates micro-batch gradients in place, and `copy_parameters_into` fills a flat
buffer (e.g. the shared-memory segment) from the module's current parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlice:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    slices: tuple[ParamSlice, ...]
    numel: int
    dtype: torch.dtype

    @classmethod
    def from_module(cls, module: nn.Module) -> FlatLayout:
        """Parameters in `named_parameters()` order (shared parameters once), packed."""
        slices, offset, dtypes = [], 0, set()
        for name, param in module.named_parameters():
            slices.append(ParamSlice(name, tuple(param.shape), offset, param.numel()))
            offset += param.numel()
            dtypes.add(param.dtype)
        if not slices:
            raise ValueError("module has no parameters: nothing to lay out")
        if len(dtypes) != 1:
            raise ValueError(f"module parameters mix dtypes {sorted(map(str, dtypes))}: cast first")
        return cls(tuple(slices), offset, dtypes.pop())

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of `flat` per parameter, shaped like it."""
        self._check(flat, "flat")
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slices]

    def _check(self, flat: torch.Tensor, what: str) -> None:
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"{what}: expected a contiguous 1-D buffer, got shape {tuple(flat.shape)}"
            )
        if flat.numel() < self.numel:
            raise ValueError(f"{what}: {flat.numel()} elements, the layout needs {self.numel}")
        if flat.dtype != self.dtype:
            raise ValueError(f"{what}: dtype {flat.dtype}, the layout needs {self.dtype}")


def _parameters(module: nn.Module, layout: FlatLayout) -> list[nn.Parameter]:
    """The module's parameters in layout order (a layout may order them its own way)."""
    params = dict(module.named_parameters())
    names = [s.name for s in layout.slices]
    if sorted(params) != sorted(names):
        raise ValueError("module parameters do not match the layout (a different module?)")
    return [params[name] for name in names]


def bind_parameters(module: nn.Module, layout: FlatLayout, flat: torch.Tensor) -> None:
    """Point every parameter of `module` at its slice of `flat` (no copy, no allocation)."""
    for param, view in zip(_parameters(module, layout), layout.views(flat)):
        param.data = view


def unbind_parameters(module: nn.Module) -> None:
    """Point every parameter of `module` at an empty tensor: no view of a slot is left, so
    the slot's memory can go (bind_parameters points them back before the next use)."""
    for param in module.parameters():
        param.data = param.data.new_empty(0)


def bind_gradients(module: nn.Module, layout: FlatLayout, flat_grad: torch.Tensor) -> None:
    """Make every `.grad` a view of `flat_grad`; autograd then accumulates into it in place."""
    for param, view in zip(_parameters(module, layout), layout.views(flat_grad)):
        param.grad = view


def copy_parameters_into(module: nn.Module, layout: FlatLayout, flat: torch.Tensor) -> None:
    """Copy the module's current parameter values into `flat` (e.g. to initialise the store)."""
    with torch.no_grad():
        for param, view in zip(_parameters(module, layout), layout.views(flat)):
            view.copy_(param)
