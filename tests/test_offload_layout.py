"""Flat layout: parameters and gradients as views of flat buffers, checked against torch."""

import copy

import pytest
import torch
from torch import nn

from megatron.offload.layout import (
    FlatLayout,
    bind_gradients,
    bind_parameters,
    copy_parameters_into,
)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def test_layout_packs_every_parameter_once_in_order():
    model = small_model()
    layout = FlatLayout.from_module(model)
    params = list(model.parameters())
    assert layout.numel == sum(p.numel() for p in params)
    assert [s.shape for s in layout.slices] == [tuple(p.shape) for p in params]
    ends = [s.offset + s.numel for s in layout.slices]
    assert [s.offset for s in layout.slices] == [0, *ends[:-1]]


def test_bound_module_computes_like_the_original_and_sees_buffer_writes():
    model, reference = small_model(), small_model()
    layout = FlatLayout.from_module(model)
    flat = torch.empty(layout.numel)
    copy_parameters_into(model, layout, flat)
    bind_parameters(model, layout, flat)
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(base <= p.data_ptr() < end for p in model.parameters())
    flat.zero_()  # a new version written into the buffer is what the module uses
    assert torch.count_nonzero(model(x)) == 0  # LayerNorm weight/bias and all Linears are 0


def test_gradients_accumulate_in_place_into_the_flat_buffer_over_micro_batches():
    model, reference = small_model(), small_model()
    layout = FlatLayout.from_module(model)
    flat_grad = torch.zeros(layout.numel)
    bind_gradients(model, layout, flat_grad)
    grad_ptrs = [p.grad.data_ptr() for p in model.parameters()]
    micro_batches = [torch.randn(3, 8) for _ in range(3)]
    for x in micro_batches:
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == grad_ptrs
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(flat_grad, expected)


def test_layout_errors_name_the_problem():
    model = small_model()
    layout = FlatLayout.from_module(model)
    with pytest.raises(ValueError, match="the layout needs"):
        bind_parameters(model, layout, torch.empty(layout.numel - 1))
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):
        bind_parameters(model, layout, torch.empty(layout.numel, dtype=torch.bfloat16))
    other = copy.deepcopy(model).append(nn.Linear(4, 2))
    with pytest.raises(ValueError, match="do not match the layout"):
        bind_parameters(other, layout, torch.empty(layout.numel + 10))
    with pytest.raises(ValueError, match="mix dtypes"):
        FlatLayout.from_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).bfloat16()))
