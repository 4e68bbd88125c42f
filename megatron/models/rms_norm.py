"""RMSNorm that autograd records alike on every device.

torch's `rms_norm` runs a fused kernel on CUDA (saving the input and one fp32 scalar per
row) but a composite of elementwise ops on the CPU, which also saves the normalized input:
the CPU device layer's device-memory book came out larger than a GPU's for the same run.
Here one autograd function saves the input and the fp32 scalar on every device, so the
saved tensors, and the memory model's price for them (megatron/schedules/memory_model.py),
are the same on both. The forward is torch's composite arithmetic (upcast, times the
reciprocal root of the mean square plus eps, times the weight, back to the input's dtype:
the CPU values are torch's bit for bit); the backward is its derivative in fp32. The module is
torch.nn.RMSNorm (its parameter is `weight`, as in megatron-core's local spec), built with
megatron-core's norm arguments.
"""

from __future__ import annotations

import torch


def _opmath(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, dims: int,
                eps: float | None) -> torch.Tensor:
        if eps is None:  # torch's default
            eps = torch.finfo(x.dtype).eps
        upcast = _opmath(x)
        reduce = tuple(range(-dims, 0))
        rstd = torch.rsqrt(upcast.pow(2).mean(reduce, keepdim=True).add_(eps))
        # in place where the tensor is this function's own (the upcast copy, the product):
        # the same ops on the same values, one fp32 tensor fewer held (x is saved, kept)
        out = upcast.mul(rstd) if upcast is x else upcast.mul_(rstd)
        if weight is not None:
            out.mul_(weight)
        out = out.type_as(x)
        ctx.save_for_backward(x, rstd, weight)
        ctx.dims = dims
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        reduce = tuple(range(-ctx.dims, 0))
        normalized = _opmath(x) * rstd
        grad_up = _opmath(grad)
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            leading = tuple(range(grad.dim() - ctx.dims))
            grad_weight = (grad_up * normalized).sum(leading).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_n = grad_up if weight is None else grad_up * _opmath(weight)
            grad_x = (rstd * (grad_n - normalized * (grad_n * normalized).mean(
                reduce, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None, None


class RMSNorm(torch.nn.RMSNorm):
    """megatron-core's norm interface (`config`, `hidden_size`, `eps`; the other keyword
    arguments of its norm builders are the config's business) over `_RMSNorm`."""

    def __init__(self, config: object, hidden_size: int, eps: float = 1e-5,
                 **_megatron_norm_options: object) -> None:
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, len(self.normalized_shape), self.eps)
