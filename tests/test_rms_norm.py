"""megatron.models.rms_norm against torch's own RMSNorm: the same forward (bit for bit on
the CPU, where torch computes the same composite), the same gradients (torch's autograd of
its composite as the reference), and what autograd keeps: the input and one fp32 scalar
per row, as torch's fused CUDA kernel keeps (not the normalized input as well)."""

import pytest
import torch

from megatron.models.rms_norm import RMSNorm


class _Config:
    pass


def _pair(hidden, dtype):
    ours = RMSNorm(_Config(), hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(hidden) * 0.1 + 1)
    theirs = torch.nn.RMSNorm(hidden, eps=1e-5).to(dtype)
    theirs.load_state_dict(ours.state_dict())  # the same parameter name: weight
    return ours, theirs


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                             (torch.bfloat16, 2e-2)])
def test_forward_and_gradients_are_torchs(dtype, tolerance):
    torch.manual_seed(0)
    ours, theirs = _pair(48, dtype)
    x = torch.randn(7, 3, 48, dtype=dtype) * 3
    grad = torch.randn(7, 3, 48, dtype=dtype)
    results = []
    for module in (ours, theirs):
        inp = x.clone().requires_grad_(True)
        out = module(inp)
        out.backward(grad)
        results.append((out, inp.grad, module.weight.grad))
    (out, gx, gw), (ref, ref_gx, ref_gw) = results
    assert torch.equal(out, ref)
    for got, want in ((gx, ref_gx), (gw, ref_gw)):
        assert got.dtype == want.dtype
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < tolerance, float(error)


def test_autograd_keeps_the_input_and_one_fp32_scalar_per_row():
    ours, _ = _pair(64, torch.bfloat16)
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours(x)
    kept = [t for t in saved if not isinstance(t, torch.nn.Parameter)]
    assert len(kept) == 2
    assert kept[0] is x
    assert kept[1].dtype == torch.float32 and kept[1].shape == (5, 2, 1)
