"""megatron-core's rotary position embedding, computed in place when autograd is off.

megatron-core's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd) makes, beside the
query or keys it rotates, the cosine product, the rotated half, the sine product, their sum
and a concatenated copy: up to three more tensors of the input's size at once, and the
rotated tensor beside the input afterwards. Without grad nothing is saved, so the same
products can be written back into the input: per half, the cosine product and the sine
product each rounded to the dtype as megatron-core rounds them, then their sum (the
rotated half's negation is exact, so subtracting the product is adding the negated one).
The result is megatron-core's bit for bit; the rotation holds two half-size products, one
input's size, and the rotated tensor is the input (the query copy grouped-query attention
makes, or a view of the fused QKV projection, which nothing reads again but the value).

SelfAttention calls `apply_rotary_pos_emb` from its module's namespace: `install` puts
`rotary_in_place_without_grad` there once. With grad, fused RoPE, packed sequences,
interleaved or multi-latent rotation, or a partial rotary dimension it calls
megatron-core's own function unchanged. The project trains without an inference context
(where megatron-core's keys may live in a cache), so writing into the keys is safe here.
"""

from __future__ import annotations

import torch

_megatron_cores = None


def _in_place_applies(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens) -> bool:
    return (not torch.is_grad_enabled() and cu_seqlens is None and not config.apply_rope_fusion
            and not config.rotary_interleaved and not config.multi_latent_attention
            and freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0)


def rotate_in_place(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin written into t (megatron-core's order and roundings)."""
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    cos1, cos2 = torch.chunk(cos, 2, dim=-1)
    sin1, sin2 = torch.chunk(sin, 2, dim=-1)
    first = x1 * cos1
    product = x2 * sin1
    first.sub_(product)  # x1 cos - x2 sin: the first half
    torch.mul(x1, sin2, out=product)
    x2.mul_(cos2).add_(product)  # x2 cos + x1 sin: the second half
    x1.copy_(first)
    return t


def rotary_in_place_without_grad(t: torch.Tensor, freqs: torch.Tensor, config,
                                 cu_seqlens=None, mscale: float = 1.0, cp_group=None
                                 ) -> torch.Tensor:
    """megatron-core's apply_rotary_pos_emb, in place in `t` when autograd is off."""
    if not _in_place_applies(t, freqs, config, cu_seqlens):
        return _megatron_cores(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale,
                               cp_group=cp_group)
    return rotate_in_place(t, freqs, mscale)


def install() -> None:
    """Route SelfAttention's RoPE through `rotary_in_place_without_grad`. Idempotent."""
    global _megatron_cores
    from megatron.core.transformer import attention

    if _megatron_cores is None:
        _megatron_cores = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = rotary_in_place_without_grad
