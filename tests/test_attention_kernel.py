"""The attention-kernel rule against torch's CUDA eligibility, and the CPU device layer's
books against what the CUDA kernel keeps.

torch's CUDA checks (torch.backends.cuda.can_use_flash_attention and its siblings) answer
False on a build without CUDA, so the expected kernels below are written from torch's
source instead (torch 2.11-2.13, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
`priority_order` (flash, efficient, math, cudnn; cuDNN first where
`check_prefer_cudnn_attention` holds: cuDNN > 9.15.0 on sm90/sm100), `can_use_flash_attention`
(fp16/bf16 on sm80-sm121, no attn_mask, head dim <= 256, grouped-query attention taken),
`can_use_mem_efficient_attention` (fp32 too, a mask taken, head dim a multiple of
`minimum_gemm_alignment`, no grouped-query attention: `check_batch_size_and_num_heads_dense
<false>`), `can_use_cudnn_attention` (fp16/bf16, masks and grouped-query attention taken).
What a CUDA kernel keeps for its backward comes from torch itself: the arguments of its
backward in derivatives.yaml, shaped by its meta function (callable on the CPU).
"""

import os

import pytest
import torch
import torch.nn.functional as F
import torchgen
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.config.attention_kernel import (
    CPU_DEVICE_GPU_ENV,
    AttentionCall,
    AttentionGpu,
    attention_kernel,
    kept_for_backward,
)
from megatron.config.errors import ConfigError
from megatron.models import attention
from megatron.models.attention import SDPAttention, cuda_kernel_on_cpu

SM80 = "sm80,cudnn=91600,cuda=13"  # A100: flash first, whatever its cuDNN
SM90 = "sm90,cudnn=91000,cuda=12"  # H100 with cuDNN 9.10: torch's default order
SM90_CUDNN = "sm90,cudnn=91600,cuda=13"  # H100 with cuDNN 9.16: cuDNN first
SM70 = "sm70,cudnn=91600,cuda=12"  # V100: no flash, no cuDNN attention, no bf16 kernel
FP32_SM80 = {(False, False): "efficient", (False, True): "efficient",  # (grouped, masked)
             (True, False): "math", (True, True): "math"}
HALF_SM80 = {(False, False): "flash", (False, True): "efficient",
             (True, False): "flash", (True, True): "math"}
EXPECTED = {  # head dim 128, sequence 2048
    SM80: {"fp32": FP32_SM80, "bf16": HALF_SM80, "fp16": HALF_SM80},
    SM90: {"fp32": FP32_SM80, "bf16": HALF_SM80, "fp16": HALF_SM80},
    SM90_CUDNN: {"fp32": FP32_SM80, "bf16": dict.fromkeys(FP32_SM80, "cudnn"),
                 "fp16": dict.fromkeys(FP32_SM80, "cudnn")},
    SM70: {"fp32": {(False, False): "efficient", (False, True): "efficient",
                    (True, False): "math", (True, True): "math"},
           "fp16": {(False, False): "efficient", (False, True): "efficient",
                    (True, False): "math", (True, True): "math"},
           "bf16": dict.fromkeys(FP32_SM80, "math")},
}
EDGES = [  # (gpu, dtype, heads, groups, head dim, masked) -> kernel, and why (torch's check)
    (SM80, "bf16", 16, 16, 256, False, "flash"),  # check_head_dim_size_flash: <= 256
    (SM80, "bf16", 16, 16, 320, False, "efficient"),  # no head-dim bound for efficient
    (SM80, "bf16", 16, 4, 320, False, "math"),
    ("sm86,cuda=12", "bf16", 16, 16, 200, False, "efficient"),  # sm86-89: (192, 224] trains not
    ("sm86,cuda=12", "bf16", 16, 16, 192, False, "flash"),
    (SM80, "fp32", 16, 16, 18, False, "math"),  # minimum_gemm_alignment: 4 for fp32 on sm80
    (SM70, "fp32", 16, 16, 18, False, "efficient"),  # ... and 1 below sm80
    (SM80, "fp16", 16, 16, 12, False, "flash"),  # flash pads the head dim to 8
    (SM80, "fp16", 16, 16, 12, True, "math"),  # efficient: 8 for fp16
    (SM90_CUDNN, "bf16", 16, 4, 256, False, "flash"),  # cuDNN above 128: left to flash
    ("sm90,cudnn=91500,cuda=13", "bf16", 16, 4, 128, False, "flash"),  # > 9.15.0, strictly
    ("sm100,cudnn=91600,cuda=12", "bf16", 16, 4, 128, True, "cudnn"),  # sm100.0, CUDA 12
    ("sm103,cudnn=91600,cuda=12", "bf16", 16, 4, 128, False, "cudnn"),  # .3 too
    ("sm101,cudnn=91600,cuda=12", "bf16", 16, 4, 128, False, "flash"),  # other minors: 13+
    ("sm101,cudnn=91600,cuda=13", "bf16", 16, 4, 128, False, "cudnn"),
    ("sm120,cudnn=91600,cuda=13", "bf16", 16, 4, 128, False, "flash"),  # not sm90/sm100
    ("sm90,cuda=13", "bf16", 16, 4, 128, True, "math"),  # no cuDNN: GQA with a mask
]
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "int64": torch.int64, "uint64": torch.uint64}


def _call(dtype, heads, groups, head_dim, masked, seq=2048, batch=1):
    return AttentionCall(dtype, heads, groups, head_dim, seq, batch,
                         (1, 1, seq, seq) if masked else None)


@pytest.mark.parametrize("gpu", list(EXPECTED))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_rule_picks_what_torch_picks_on_cuda(gpu, dtype):
    for (grouped, masked), expected in EXPECTED[gpu][dtype].items():
        call = _call(dtype, 32, 8 if grouped else 32, 128, masked)
        assert attention_kernel(call, AttentionGpu.parse(gpu)) == expected, (grouped, masked)


@pytest.mark.parametrize("gpu,dtype,heads,groups,head_dim,masked,expected", EDGES)
def test_the_rule_at_the_edges_of_torchs_conditions(gpu, dtype, heads, groups, head_dim,
                                                     masked, expected):
    call = _call(dtype, heads, groups, head_dim, masked)
    assert attention_kernel(call, AttentionGpu.parse(gpu)) == expected


def test_deterministic_algorithms_and_the_unfused_backend():
    gpu = AttentionGpu.parse(SM90_CUDNN)
    call = _call("bf16", 32, 8, 128, False)
    assert attention_kernel(call, gpu) == "cudnn"
    deterministic = AttentionGpu(gpu.capability, gpu.cudnn_version, 13, deterministic=True)
    assert attention_kernel(call, deterministic) == "flash"  # check_cudnn_deterministic
    for backend in ("unfused", "local"):
        assert attention_kernel(call, gpu, backend) == "unfused"


def test_the_cpu_layers_gpu_is_read_once_written(monkeypatch):
    for text in (SM80, SM90_CUDNN, "sm100,cuda=12"):
        assert AttentionGpu.parse(AttentionGpu.parse(text).describe()) == AttentionGpu.parse(text)
    for bad in ("h100", "sm9", "sm90,cudnn=9.16", "sm90,rocm=6"):
        with pytest.raises(ConfigError) as error:
            AttentionGpu.parse(bad)
        assert str(error.value).startswith(f"{CPU_DEVICE_GPU_ENV} {bad!r}: expected sm")
    monkeypatch.delenv(CPU_DEVICE_GPU_ENV, raising=False)
    assert attention.device_gpu(torch.device("cpu")) == AttentionGpu.parse("sm80")
    monkeypatch.setenv(CPU_DEVICE_GPU_ENV, SM90_CUDNN)
    assert attention.device_gpu(torch.device("cpu")) == AttentionGpu.parse(SM90_CUDNN)


def test_a_gpu_is_read_as_the_cpu_layer_plays_it(monkeypatch):
    """What cuda_gpu reads of an H100 with cuDNN 9.16 under CUDA 13 (torch's calls stood in
    for), and its description, which tests/test_cuda_pipeline.py hands to the CPU runs."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91600)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    gpu = attention.cuda_gpu.__wrapped__(0)
    assert gpu == AttentionGpu.parse(SM90_CUDNN) and gpu.describe() == SM90_CUDNN
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    deprioritized = attention.cuda_gpu.__wrapped__(0)
    call = _call("bf16", 32, 8, 128, False)
    assert attention_kernel(call, deprioritized) == "flash"
    assert attention_kernel(call, AttentionGpu.parse(deprioritized.describe())) == "flash"


def test_a_bad_gpu_for_the_cpu_layer_is_one_line_before_anything_starts(monkeypatch, capsys):
    import torch.distributed as dist

    from megatron.training.training import main

    if dist.is_initialized():
        pytest.skip("a process group from an earlier test: the refusal comes before one")
    monkeypatch.setenv(CPU_DEVICE_GPU_ENV, "h100")
    with pytest.raises(SystemExit) as stop:
        main(["--model-preset", "tiny", "--train-iters", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"{CPU_DEVICE_GPU_ENV} 'h100': expected sm<major>"
                                             "<minor>[,cudnn=<version as torch.backends.cudnn"
                                             ".version() gives it>][,cuda=<CUDA major version"
                                             ">], for example sm80 or sm90,cudnn=91600,"
                                             "cuda=13"), err
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_on_a_gpu_the_rule_is_torchs_own_choice(head_dim):
    """torch's dispatcher asked directly (torch._fused_sdp_choice: the kernel it would run),
    for megatron-core's layout ([s, b, n, d] permuted), in each dtype, with and without
    grouped-query attention and a mask, on the GPU at hand."""
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # at::SDPBackend
    gpu = attention.cuda_gpu(torch.cuda.current_device())
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                        (torch.float16, "fp16")):
        for groups in (16, 4):
            for masked in (False, True):
                seq = 256
                q, k, v = (torch.randn(seq, 2, n, head_dim, device="cuda", dtype=dtype)
                           .permute(1, 2, 0, 3).requires_grad_() for n in (16, groups, groups))
                mask = (torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda").tril()
                        if masked else None)
                torch_choice = names[torch._fused_sdp_choice(
                    q, k, v, mask, is_causal=not masked, enable_gqa=groups != 16)]
                call = AttentionCall(name, 16, groups, head_dim, seq, 2,
                                     (1, 1, seq, seq) if masked else None)
                assert attention_kernel(call, gpu) == torch_choice, (name, groups, masked)


# --- what a CUDA kernel keeps, from torch ---------------------------------------------------

OPS = {"flash": "_scaled_dot_product_flash_attention",
       "efficient": "_scaled_dot_product_efficient_attention",
       "cudnn": "_scaled_dot_product_cudnn_attention"}


def _derivative(op: str):
    """(input names, [(output type, output name)], backward's argument names) of `op` in
    torch's derivatives.yaml."""
    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "autograd",
                        "derivatives.yaml")
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"- name: {op}("))
    arguments, results = lines[start][len(f"- name: {op}("):].split(") -> (")
    inputs = [a.split()[-1] for a in arguments.split(",") if a.strip().startswith("Tensor")]
    outputs = [tuple(r.split()) for r in results.rstrip(")").split(",")]
    backward = next(line for line in lines[start + 1:] if "_backward" in line)
    names = [a.strip() for a in backward.split("(", 1)[1].rsplit(")", 1)[0].split(",")]
    return inputs, outputs, names


def _torch_cuda_kept(kernel: str, q, k, v, mask):
    """What `kernel` keeps on CUDA for q, k, v (and a boolean mask, True = attend), as
    torch's scaled_dot_product_attention prepares them (attention.cpp): flash pads the head
    dimension to 8 (pad_last_dim), a mask becomes an additive bias in the query's dtype
    (convert_boolean_attn_mask), expanded to every head for the efficient kernel
    (preprocess_mask). Returns [(shape, dtype)]."""
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask.logical_not(),
                                                                   float("-inf"))
    if kernel == "flash":
        q, k, v = (F.pad(t, (0, -t.shape[-1] % 8)) for t in (q, k, v))
        args = {"query": q, "key": k, "value": v}
        call = (0.0, True)
    else:
        if kernel == "efficient" and bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        args = {"query": q, "key": k, "value": v, "attn_bias": bias}
        call = (True, 0.0, bias is None)
    inputs, outputs, backward = _derivative(OPS[kernel])
    meta = [None if t is None else t.to("meta") for t in args.values()]
    results = getattr(torch.ops.aten, OPS[kernel])(*meta, *call)
    kept = [args[name] for name in inputs if name in backward and args.get(name) is not None]
    kept += [r for (kind, name), r in zip(outputs, results)
             if kind == "Tensor" and name in backward and r is not None]
    return sorted((tuple(t.shape), t.dtype) for t in kept)


def _kept(fn):
    """[(shape, dtype)] of what autograd keeps of `fn()`."""
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sorted(kept)


def _project_kept(kernel, call):
    return sorted((t.shape, TORCH_DTYPES[t.dtype]) for t in kept_for_backward(kernel, call))


def _qkv(dtype, heads, groups, head_dim, seq=40, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, seq, head_dim, generator=g).to(dtype).requires_grad_()
            for n in (heads, groups, groups)]


CPU_CASES = [  # (kernel, dtype, heads, groups, head dim, masked)
    ("flash", torch.bfloat16, 4, 2, 16, False),
    ("flash", torch.float16, 4, 4, 12, False),  # padded to 16
    ("flash", torch.bfloat16, 6, 1, 20, False),  # one query group, padded to 24
    ("efficient", torch.float32, 4, 4, 16, False),  # the log-sum-exp padded to 64
    ("efficient", torch.float32, 4, 4, 16, True),
    ("cudnn", torch.bfloat16, 4, 2, 16, False),
    ("cudnn", torch.bfloat16, 4, 2, 16, True),
]


@pytest.mark.parametrize("kernel,dtype,heads,groups,head_dim,masked", CPU_CASES)
def test_the_cpu_keeps_what_the_cuda_kernel_keeps_and_computes_attention(
        kernel, dtype, heads, groups, head_dim, masked):
    q, k, v = _qkv(dtype, heads, groups, head_dim)
    seq = q.shape[2]
    causal = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril()  # True = attend
    call = AttentionCall({torch.float32: "fp32", torch.bfloat16: "bf16",
                          torch.float16: "fp16"}[dtype], heads, groups, head_dim, seq, 2,
                         (1, 1, seq, seq) if masked else None)
    out = []
    kept = _kept(lambda: out.append(cuda_kernel_on_cpu(
        kernel, call, q, k, v, causal.logical_not() if masked else None, None)))
    torch_kept = _torch_cuda_kept(kernel, q, k, v, causal if masked else None)
    assert kept == torch_kept == _project_kept(kernel, call)
    # and it computes attention: against torch's math kernel, forward and backward
    grad = torch.linspace(-1, 1, out[0].numel()).view_as(out[0]).to(dtype)
    got = [out[0], *torch.autograd.grad(out[0], (q, k, v), grad)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=heads != groups)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), grad)]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_math_keeps_what_the_table_says(dtype, name):
    """Math is one composite on every device (_scaled_dot_product_attention_math): fp32,
    K and V repeated to every head, the probabilities kept twice."""
    q, k, v = _qkv(dtype, 4, 2, 16, seq=32)
    with sdpa_kernel([SDPBackend.MATH]):
        kept = _kept(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))
    assert kept == _project_kept("math", AttentionCall(name, 4, 2, 16, 32, 2))


# --- the cuda-pipeline configurations ----------------------------------------------------------


class _TorchCudaKernelBooks(torch.autograd.Function):
    """Attention computed by torch's math kernel, keeping what `kernel` keeps on CUDA
    (torch's own description: _torch_cuda_kept): the books of a CUDA run, on the CPU."""

    @staticmethod
    def forward(ctx, q, k, v, kernel):
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        ctx.save_for_backward(*(torch.empty(shape, dtype=dtype) for shape, dtype
                                in _torch_cuda_kept(kernel, q, k, v, None)))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("only the forward's books are compared")


def _with_cuda_kernel(kernel):
    """SDPAttention.forward with `kernel` as CUDA runs it, chosen by the table above."""
    def forward(self, query, key, value, attention_mask, **_):
        sq, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if kernel == "math":  # the CPU has it: the same composite as on CUDA
            with sdpa_kernel([SDPBackend.MATH]):
                context = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         enable_gqa=heads != k.shape[1])
        else:
            context = _TorchCudaKernelBooks.apply(q, k, v, kernel)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)
    return forward


def _layer_books(dtype):
    """The CPU device layer's books of one decoder layer of tests/test_cuda_pipeline.py's
    model (its RUN flags: hidden 64, FFN 160, 4 heads in 2 groups, sequence 32, micro-batch
    2), as the executor counts them."""
    from megatron.models.llama import LlamaConfig, build_piece
    from megatron.pipeline.executor import _saved_bytes

    cfg = LlamaConfig(num_layers=1, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                      num_query_groups=2, vocab_size=512, seq_length=32, seed=3)
    piece = build_piece(cfg, 1).to(dtype)
    hidden = torch.randn(32, 2, 64, dtype=dtype, requires_grad=True)
    with _saved_bytes(piece) as saved:
        piece(hidden, {})
    return saved.nbytes


@pytest.fixture(scope="module")
def _megatron_core():
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    initialize_distributed()
    yield
    shutdown_distributed()


@pytest.mark.parametrize("gpu", [SM80, SM90_CUDNN])
def test_cuda_pipeline_configurations_keep_on_the_cpu_what_cuda_keeps(
        gpu, monkeypatch, _megatron_core):
    """The CPU device layer playing `gpu` books, for tests/test_cuda_pipeline.py's model in
    its three dtypes, what the layer keeps with the kernel CUDA takes there (math for fp32
    with grouped-query attention; flash, or cuDNN first on sm90 with cuDNN 9.16, in half);
    the CPU's own unpinned choice (flash) kept 2.4 % less in fp32 (the test can fail)."""
    monkeypatch.setenv(CPU_DEVICE_GPU_ENV, gpu)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                        (torch.float16, "fp16")):
        cpu_layer = _layer_books(dtype)
        with monkeypatch.context() as patch:
            patch.setattr(SDPAttention, "forward",
                          _with_cuda_kernel(EXPECTED[gpu][name][(True, False)]))
            assert _layer_books(dtype) == cpu_layer, name
        if dtype == torch.float32:
            with monkeypatch.context() as patch:  # flash, the CPU's choice before the rule
                patch.setattr(attention, "_choose", lambda call, gpu: "flash")
                assert _layer_books(dtype) < cpu_layer
