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

import torch

_adapted = False


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
