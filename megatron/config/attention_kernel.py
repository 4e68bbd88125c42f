"""Which kernel computes core attention: one rule for CUDA and for the CPU device layer.

Left alone, torch's `scaled_dot_product_attention` picks a kernel at every call by its own
heuristics, from the dtype, the head layout, the mask, the head dimension, the GPU, its
cuDNN and torch's version; the CPU has only flash and math. Each kernel keeps other tensors
for the backward, so the device-memory books of a GPU and of the CPU device layer playing
it would disagree (fp32 with grouped-query attention: math on CUDA, flash on the CPU).

So the project decides, here, once: `attention_kernel` is torch's own choice written out
(torch 2.11 to 2.13, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: the first kernel
of `priority_order` whose `can_use_*` conditions hold, for dense inputs without dropout, as
megatron-core's attention calls it), and megatron.models.attention runs that kernel pinned
(`torch.nn.attention.sdpa_kernel`). The CPU device layer plays a GPU (`cpu_layer_gpu`): it
computes math with math, the fused kernels with its own flash kernel, and keeps what the
CUDA kernel keeps (`kept_for_backward`, from torch's derivatives.yaml and the shapes its
meta functions give), which is also what the memory model counts.

Where torch would take cuDNN for a head dimension above 128 (cuDNN 9.22 and later on sm90
and sm100, with a torch built against cudnn-frontend 1.24) the rule takes the next kernel
(flash): whether the torch build has that frontend cannot be read from Python, and a pinned
kernel must be one torch accepts.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from megatron.config.errors import ConfigError
from megatron.config.model import materializes_attention_scores

# torch's SDPA kernels, by the project's names; "unfused" is megatron-core's DotProductAttention.
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")
KERNELS = (*SDPA_KERNELS, "unfused")
HALF_DTYPES = ("fp16", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8, "uint64": 8}

# The GPU the CPU device layer plays, as `AttentionGpu.parse` reads it.
CPU_DEVICE_GPU_ENV = "MEGATRON_CPU_DEVICE_GPU"
CPU_DEVICE_GPU_DEFAULT = "sm80"  # an A100: flash first, whatever its cuDNN
GPU_EXPECTED = ("sm<major><minor>[,cudnn=<version as torch.backends.cudnn.version() gives "
                "it>][,cuda=<CUDA major version>], for example sm80 or sm90,cudnn=91600,cuda=13")


@dataclass(frozen=True)
class AttentionGpu:
    """What of a GPU and its software the choice reads."""

    capability: tuple[int, int]  # compute capability (major, minor)
    cudnn_version: int | None = None  # cuDNN at run time (91600 = 9.16.0); None: none
    cuda_major: int = 13  # the CUDA torch was built with
    deterministic: bool = False  # torch.use_deterministic_algorithms(True), not warn-only
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED=1

    @classmethod
    def parse(cls, text: str, where: str = CPU_DEVICE_GPU_ENV) -> AttentionGpu:
        """`sm90,cudnn=91600,cuda=13`; a bad text is a ConfigError naming `where`."""
        parts = [p.strip() for p in text.split(",")]
        head = parts[0].lower()
        if not (head.startswith("sm") and head[2:].isdigit() and len(head) >= 4):
            raise ConfigError(where, repr(text), f"expected {GPU_EXPECTED}")
        fields = {"cudnn": None, "cuda": 13}
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key not in fields or not value.isdigit():
                raise ConfigError(where, repr(text), f"expected {GPU_EXPECTED}")
            fields[key] = int(value)
        digits = head[2:]
        return cls((int(digits[:-1]), int(digits[-1])), fields["cudnn"], fields["cuda"])

    def describe(self) -> str:
        """The text `parse` reads back to a GPU that takes the same kernels (a deprioritized
        cuDNN comes after math, which takes everything: as good as none)."""
        major, minor = self.capability
        cudnn = self.cudnn_version if not self.cudnn_deprioritized else None
        return ",".join([f"sm{major}{minor}", *([f"cudnn={cudnn}"] if cudnn else []),
                         f"cuda={self.cuda_major}"])


def cpu_layer_gpu() -> AttentionGpu:
    """The GPU the CPU device layer plays ($MEGATRON_CPU_DEVICE_GPU, default sm80)."""
    return _parsed(os.environ.get(CPU_DEVICE_GPU_ENV, "").strip() or CPU_DEVICE_GPU_DEFAULT)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> AttentionGpu:  # read at every attention call
    return AttentionGpu.parse(text)


@dataclass(frozen=True)
class AttentionCall:
    """One core-attention call as megatron-core makes it: [batch, heads, sequence, head dim]
    queries, keys and values of `groups` heads, causal (is_causal) or with a mask."""

    dtype: str  # "fp32", "bf16" or "fp16"
    heads: int
    groups: int  # key/value heads
    head_dim: int
    seq_length: int
    batch: int = 1
    mask_shape: tuple[int, ...] | None = None  # None: is_causal, no mask tensor

    @property
    def grouped(self) -> bool:
        return self.groups != self.heads


def _capability_between(gpu: AttentionGpu, low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= gpu.capability <= high  # check_sm_version


def flash_eligible(call: AttentionCall, gpu: AttentionGpu) -> bool:
    """can_use_flash_attention."""
    major, minor = gpu.capability
    training_head_dim_ok = (not (_capability_between(gpu, (8, 6), (8, 9))
                                 or _capability_between(gpu, (12, 0), (12, 1)))
                            or call.head_dim <= 192 or call.head_dim > 224)
    dtypes = HALF_DTYPES if major >= 8 else ("fp16",)  # check_dtypes_low_precision
    return (call.mask_shape is None  # check_for_attn_mask
            and call.head_dim <= 256  # check_head_dim_size_flash
            and _capability_between(gpu, (8, 0), (12, 1))  # ..._hardware_support
            and training_head_dim_ok  # ..._head_dim_gt192_constraints_on_sm86_89_or_120
            and call.dtype in dtypes
            and call.heads % call.groups == 0)  # check_batch_size_and_num_heads_dense<gqa>


def _gemm_alignment(dtype: str, gpu: AttentionGpu) -> int:
    """minimum_gemm_alignment: what the head dimension must be a multiple of."""
    major = gpu.capability[0]
    half = dtype in HALF_DTYPES
    alignment = 4 if major >= 8 else 1
    if major >= 8 or (major >= 7 and half):  # use_tensor_cores
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def efficient_eligible(call: AttentionCall, gpu: AttentionGpu) -> bool:
    """can_use_mem_efficient_attention (no grouped-query attention in torch 2.13). Its
    check of the inputs' storage offsets holds whenever the head dimension's does:
    megatron-core's value is a view into the fused QKV projection at a multiple of the head
    dimension, its query and key are RoPE's new tensors."""
    dtypes = ("fp16", "fp32", "bf16") if gpu.capability[0] >= 8 else ("fp16", "fp32")
    return (_capability_between(gpu, (5, 0), (12, 1))
            and call.head_dim % _gemm_alignment(call.dtype, gpu) == 0  # ..._mem_efficient
            and not call.grouped  # check_batch_size_and_num_heads_dense<false>
            and call.dtype in dtypes)


def cudnn_eligible(call: AttentionCall, gpu: AttentionGpu) -> bool:
    """can_use_cudnn_attention (head dimensions up to 128, see the module's docstring)."""
    return (gpu.cudnn_version is not None and gpu.cudnn_version >= 90000
            and not gpu.deterministic  # check_cudnn_deterministic
            and call.dtype in HALF_DTYPES and gpu.capability[0] >= 8
            and _capability_between(gpu, (8, 0), (12, 1))  # ..._hardware_support
            and call.head_dim <= 128 and call.head_dim % 8 == 0  # check_cudnn_tensor_shapes
            and call.seq_length != 1
            and call.heads % call.groups == 0)  # <supports_gqa, not requires_same_num_heads>


ELIGIBLE = {"flash": flash_eligible, "efficient": efficient_eligible,
            "cudnn": cudnn_eligible, "math": lambda call, gpu: True}


def prefers_cudnn(gpu: AttentionGpu) -> bool:
    """check_prefer_cudnn_attention: cuDNN after 9.15.0 on sm90 and sm100 (with CUDA
    before 13 only their .0 and .3 variants) goes first."""
    major, minor = gpu.capability
    return (not gpu.cudnn_deprioritized and gpu.cudnn_version is not None
            and gpu.cudnn_version > 91500 and major in (9, 10)
            and (gpu.cuda_major >= 13 or minor in (0, 3)))


def priority(gpu: AttentionGpu) -> tuple[str, ...]:
    """priority_order: torch's default order (Context.h) or cuDNN first."""
    if prefers_cudnn(gpu):
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math", "cudnn")


def attention_kernel(call: AttentionCall, gpu: AttentionGpu,
                     attention_backend: str = "auto") -> str:
    """The kernel that computes `call` on `gpu`: "unfused" where Megatron's
    --attention-backend keeps megatron-core's DotProductAttention, else the first of
    torch's priority order whose conditions hold (math always does)."""
    if materializes_attention_scores(attention_backend):
        return "unfused"
    return next(k for k in priority(gpu) if ELIGIBLE[k](call, gpu))


@dataclass(frozen=True)
class SavedTensor:
    what: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def kept_for_backward(kernel: str, call: AttentionCall) -> tuple[SavedTensor, ...]:
    """What autograd keeps of one call of `kernel` on CUDA (torch 2.13: the arguments of the
    kernel's backward in derivatives.yaml, shaped as its meta function shapes them, after
    scaled_dot_product_attention's own preparation of the inputs in attention.cpp)."""
    b, n, g, s, d, dt = (call.batch, call.heads, call.groups, call.seq_length, call.head_dim,
                         call.dtype)
    if kernel == "math":
        # _scaled_dot_product_attention_math computes in fp32 (half inputs upcast), with K
        # and V repeated to every head: the scaled Q, K^T, the probabilities (kept by softmax
        # and by the second matmul) and V.
        return (SavedTensor("query", (b * n, s, d), "fp32"),
                SavedTensor("key", (b * n, d, s), "fp32"),
                SavedTensor("probabilities", (b, n, s, s), "fp32"),
                SavedTensor("value", (b * n, s, d), "fp32"),
                SavedTensor("probabilities", (b * n, s, s), "fp32"))
    if kernel == "flash":
        d = _round_up(d, 8)  # pad_last_dim<8>: the padded inputs and output are kept
    inputs = (SavedTensor("query", (b, n, s, d), dt), SavedTensor("key", (b, g, s, d), dt),
              SavedTensor("value", (b, g, s, d), dt))
    output = SavedTensor("output", (b, n, s, d), dt)
    bias = ()
    if call.mask_shape is not None and kernel == "efficient":
        # convert_boolean_attn_mask, then preprocess_mask's expand to every head
        bias = (SavedTensor("attn_bias", (b, n, s, s), dt),)
    elif call.mask_shape is not None and kernel == "cudnn":
        bias = (SavedTensor("attn_bias", call.mask_shape, dt),)
    if kernel == "flash":
        return (*inputs, output, SavedTensor("logsumexp", (b, n, s), "fp32"),
                SavedTensor("rng_state", (2,), "uint64"), SavedTensor("unused", (), "uint64"))
    lse = {"efficient": (b, n, _round_up(s, 32)), "cudnn": (b, n, s, 1)}[kernel]
    return (*inputs, *bias, output, SavedTensor("logsumexp", lse, "fp32"),
            SavedTensor("philox_seed", (), "int64"), SavedTensor("philox_offset", (), "int64"))


def kept_bytes(kernel: str, call: AttentionCall) -> int:
    return sum(t.nbytes for t in kept_for_backward(kernel, call))
