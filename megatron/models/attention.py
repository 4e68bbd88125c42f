"""Core attention through torch's scaled_dot_product_attention, for layers without
Transformer Engine.

megatron-core's local spec computes attention unfused (DotProductAttention): it
materializes the sequence x sequence scores and probabilities of every head, in memory and
in time. `SDPAttention` takes its place in the layer spec and hands the same computation to
torch's fused kernels (flash, cuDNN or memory-efficient on CUDA, flash on the CPU), which
keep one log-sum-exp per head and token instead. It has no parameters, so the layer's
parameter names and checkpoints stay those of megatron-core's local spec.

Which kernel a run uses follows Megatron-LM's `--attention-backend`: `unfused` and `local`
keep megatron-core's DotProductAttention, `auto`, `flash` and `fused` take torch's SDPA
(Transformer Engine, where it is used, makes its own choice).
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F
from torch import Tensor, nn

from megatron.config.model import materializes_attention_scores

# Megatron-LM's --attention-backend values (megatron.core.transformer.enums.AttnBackend).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def core_attention_kernel(attention_backend: str = "auto") -> str:
    """"unfused" (megatron-core's DotProductAttention) or "sdpa" (torch's fused kernels)
    for the local spec, by Megatron's --attention-backend value."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention_backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return "unfused" if materializes_attention_scores(attention_backend) else "sdpa"


class SDPAttention(nn.Module):
    """A megatron-core core_attention module (DotProductAttention's constructor and call)
    computing causal, grouped-query attention with `F.scaled_dot_product_attention`.

    Inputs are megatron-core's [sequence, batch, heads, head dim] (key and value with the
    query-group count of heads); the output is [sequence, batch, heads x head dim]. Without a
    mask it attends causally (is_causal: no sequence x sequence tensor anywhere); a given
    mask follows megatron-core's convention, True = masked. A plain torch module (it holds
    no parameters, so megatron-core's sharded state dict of the layer has nothing of it):
    importing megatron-core's MegatronModule here would load megatron-core with every
    import of the model code.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__()
        self.config = config
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attention dropout": dropout != 0.0,
            "context parallelism": config.context_parallel_size != 1,
            "tensor parallelism": config.tensor_model_parallel_size != 1,
            "sliding-window attention": config.window_size is not None,
            f"softmax type {config.softmax_type!r}": config.softmax_type != "vanilla",
            "query-key layer scaling": config.apply_query_key_layer_scaling,
            f"mask type {attn_mask_type}": attn_mask_type != AttnMaskType.causal,
        }
        refused = [what for what, present in unsupported.items() if present]
        if refused:
            raise ValueError(f"SDPAttention does not support {', '.join(refused)}: use "
                             "--attention-backend unfused")
        self.softmax_scale = softmax_scale  # None: SDPA's 1/sqrt(head dim), as megatron-core's
        self.grouped = config.num_query_groups != config.num_attention_heads
        self.current_max_attn_logits = None  # read by megatron-core's QK-clip only

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes neither an attention bias nor packed "
                             "sequences: use --attention-backend unfused")
        sq, b, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d]: views, the head dimension stays contiguous
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=self.grouped)
        else:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask.logical_not(), scale=self.softmax_scale,
                enable_gqa=self.grouped)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def with_sdpa_core_attention(spec):
    """megatron-core's local layer spec with SDPAttention as its core attention."""
    attention = spec.submodules.self_attention
    return replace(spec, submodules=replace(
        spec.submodules, self_attention=replace(
            attention, submodules=replace(attention.submodules, core_attention=SDPAttention))))
