"""Lets megatron-core's model code run on a host without CUDA.

megatron-core 0.16.1 assumes CUDA in a few places on the model path that this project
uses (embedding, transformer layers with the local spec, rotary embedding, dot-product
attention, output layer): `torch.cuda.current_device()` in rotary_pos_embedding.py and in
core/utils.py (the global memory buffer attention uses), and the CUDA RNG tracker's fork()
around attention and embedding dropout. The rest of what we use (indexed datasets,
GPTDataset, OptimizerParamScheduler, parallel_state with gloo) needs no change, and the
project replaces megatron-core's pipeline schedules and offloading optimizer instead of
adapting them. Every adaptation lives here, one comment each. On a machine with CUDA
nothing is patched.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

_adapted = False


def _not_compiled(fn: Callable | None = None, **_options) -> Callable:
    return fn if fn is not None else (lambda f: f)


def import_megatron_core() -> None:
    """Import megatron-core once per process, without torch.compile when CUDA is absent.

    Importing megatron-core wraps its fused element-wise helpers in torch.compile
    (megatron/core/jit.py), which imports the dynamo and inductor stack: about 2 s of
    every process start, for kernels that only a GPU compiles. Without CUDA the helpers
    stay plain functions (the same arithmetic, run eagerly). Our packages that use
    megatron-core call this first (megatron/training/__init__.py).
    """
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    compile_ = torch.compile
    torch.compile = _not_compiled
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


def _cpu_current_device() -> str:
    return "cpu"


def adapt_megatron_core_for_host() -> bool:
    """Apply the adaptations if CUDA is absent. Returns True if anything was patched.

    Idempotent; safe to call from every process and every entry point.
    """
    global _adapted
    if torch.cuda.is_available():
        return False
    if not _adapted:
        # rotary_pos_embedding.py (RotaryEmbedding.__init__/get_emb), core/utils.py (the global
        # memory buffer used by attention) and dot_product_attention.py place tensors on
        # `torch.cuda.current_device()`, which raises on a CPU build: answer "cpu" instead.
        torch.cuda.current_device = _cpu_current_device
        _adapted = True
    # Attention and embedding dropout wrap their calls in the CUDA RNG tracker's fork(),
    # which reads CUDA RNG state; the inference-mode tracker makes fork() a null context
    # (force_reset because an existing tracker is kept otherwise).
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True
