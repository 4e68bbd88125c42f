"""Core attention through torch's scaled_dot_product_attention, for layers without
Transformer Engine.

megatron-core's local spec computes attention unfused (DotProductAttention): it
materializes the sequence x sequence scores and probabilities of every head, in memory and
in time. `SDPAttention` takes its place in the layer spec and hands the same computation to
torch's SDPA. It has no parameters, so the layer's parameter names and checkpoints stay
those of megatron-core's local spec.

Which kernel a run uses follows Megatron-LM's `--attention-backend`: `unfused` and `local`
keep megatron-core's DotProductAttention, `auto`, `flash` and `fused` take torch's SDPA
(Transformer Engine, where it is used, makes its own choice). Which SDPA kernel computes a
call (flash, memory-efficient, cuDNN or math) is megatron.config.attention_kernel's rule,
for this process's GPU, or on the CPU device layer for the GPU it plays; the kernel runs
pinned (`sdpa_kernel`). The CPU has only flash and math: it computes math with math, and a
fused CUDA kernel with its flash kernel, keeping what the CUDA kernel keeps for the
backward, so that the device-memory books of both layers agree.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.config.attention_kernel import (
    AttentionCall,
    AttentionGpu,
    attention_kernel,
    cpu_layer_gpu,
)
from megatron.config.model import materializes_attention_scores

# Megatron-LM's --attention-backend values (megatron.core.transformer.enums.AttnBackend).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_RAN: set[str] = set()  # the SDPA kernels this process has run


def core_attention_kernel(attention_backend: str = "auto") -> str:
    """"unfused" (megatron-core's DotProductAttention) or "sdpa" (torch's fused kernels)
    for the local spec, by Megatron's --attention-backend value."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention_backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return "unfused" if materializes_attention_scores(attention_backend) else "sdpa"


@functools.cache
def cuda_gpu(index: int) -> AttentionGpu:
    """What the kernel rule reads of CUDA device `index` and of this torch build."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    deprioritized = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in (
        "1", "ON", "YES", "TRUE", "Y")  # c10::utils::check_env
    return AttentionGpu(torch.cuda.get_device_capability(index), cudnn,
                        int((torch.version.cuda or "0").split(".")[0]),
                        cudnn_deprioritized=deprioritized)


def device_gpu(device: torch.device) -> AttentionGpu:
    """The GPU whose kernel computes attention on `device`: the GPU itself, or the one the
    CPU device layer plays; with torch's deterministic algorithms (not warn-only) on."""
    gpu = (cuda_gpu(device.index if device.index is not None else torch.cuda.current_device())
           if device.type == "cuda" else cpu_layer_gpu())
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():
        gpu = replace(gpu, deterministic=True)
    return gpu


_choose = functools.lru_cache(maxsize=64)(attention_kernel)


def forget_kernels_run() -> None:
    """Start `kernels_run` afresh (a run starts)."""
    _RAN.clear()


def kernels_run(attention_backend: str = "auto", implementation: str = "local") -> str:
    """What computed core attention in this process since `forget_kernels_run`, as the
    training metrics and the megatron-core baseline name it: the SDPA kernels SDPAttention
    pinned ("flash", "efficient", "cudnn" or "math"; comma-separated when several), else
    "unfused" (megatron-core's DotProductAttention, by --attention-backend) or
    "transformer_engine" (`implementation`: its layer spec makes its own choice)."""
    if _RAN:
        return ",".join(sorted(_RAN))
    if implementation == "transformer_engine":
        return "transformer_engine"
    return "unfused" if core_attention_kernel(attention_backend) == "unfused" else "none"


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
        self.kernel: str | None = None  # the SDPA kernel of the last call

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes neither an attention bias nor packed "
                             "sequences: use --attention-backend unfused")
        sq, b, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d]: views, the head dimension stays contiguous
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.dtype not in DTYPE_NAMES:
            raise ValueError(f"SDPAttention: dtype {q.dtype}: expected one of "
                             f"{', '.join(map(str, DTYPE_NAMES))}")
        call = AttentionCall(DTYPE_NAMES[q.dtype], heads, k.shape[1], head_dim, sq, b,
                             None if attention_mask is None else tuple(attention_mask.shape))
        self.kernel = _choose(call, device_gpu(q.device))
        _RAN.add(self.kernel)
        if q.device.type == "cuda" or self.kernel == "math":
            with sdpa_kernel([SDPA_BACKENDS[self.kernel]]):
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else
                    attention_mask.logical_not(), is_causal=attention_mask is None,
                    scale=self.softmax_scale, enable_gqa=self.grouped)
        else:
            context = cuda_kernel_on_cpu(self.kernel, call, q, k, v, attention_mask,
                                         self.softmax_scale)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def cuda_kernel_on_cpu(kernel: str, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor,
                       mask: Tensor | None, scale: float | None) -> Tensor:
    """CUDA's fused `kernel` on the CPU: computed by the CPU's flash kernel, keeping what
    `kernel` keeps on CUDA (megatron.config.attention_kernel.kept_for_backward), with
    scaled_dot_product_attention's preparation of the inputs (attention.cpp): a boolean
    mask (True = masked, megatron-core's) becomes an additive one in the query's dtype;
    flash pads the head dimension to a multiple of 8."""
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            mask, float("-inf"))
    head_dim = q.shape[-1]
    padding = -head_dim % 8 if kernel == "flash" else 0
    if padding:
        scale = head_dim ** -0.5 if scale is None else scale  # of the unpadded head dim
        q, k, v = (F.pad(t, (0, padding)) for t in (q, k, v))
    out = _CudaKernelOnCpu.apply(q, k, v, bias, kernel, call, scale)
    return out[..., :head_dim] if padding else out


class _CudaKernelOnCpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, kernel: str,
                call: AttentionCall, scale: float | None) -> Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, bias is None, attn_mask=bias, scale=scale)
        b, n, s = lse.shape
        kept_bias = ()
        if kernel == "flash":  # [b, n, s], and the RNG state a dropout would read
            kept_lse = lse
            extras = (torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64))
        else:  # and the philox seed and offset
            extras = (torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64))
            if kernel == "efficient":  # [b, n, s] padded to a multiple of 32
                kept_lse = lse.new_zeros(b, n, -(-s // 32) * 32)
                kept_lse[..., :s] = lse
            else:  # cuDNN: [b, n, s, 1]
                kept_lse = lse.unsqueeze(-1)
            if bias is not None:  # the efficient kernel's bias is expanded to every head
                kept_bias = (bias.expand(b, n, s, s) if kernel == "efficient" else bias,)
        ctx.kernel, ctx.scale, ctx.seq, ctx.has_bias = kernel, scale, s, bias is not None
        ctx.save_for_backward(q, k, v, *kept_bias, out, kept_lse, *extras)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        bias = saved[3] if ctx.has_bias else None
        out, kept_lse = saved[3 + ctx.has_bias:5 + ctx.has_bias]
        lse = kept_lse[..., :ctx.seq] if kept_lse.dim() == 3 else kept_lse.squeeze(-1)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, bias is None, attn_mask=bias, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def with_sdpa_core_attention(spec):
    """megatron-core's local layer spec with SDPAttention as its core attention."""
    attention = spec.submodules.self_attention
    return replace(spec, submodules=replace(
        spec.submodules, self_attention=replace(
            attention, submodules=replace(attention.submodules, core_attention=SDPAttention))))
