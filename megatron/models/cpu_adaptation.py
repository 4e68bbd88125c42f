"""Lets megatron-core's model code run on a host without CUDA.

megatron-core 0.16.1 assumes CUDA in a few places on the model path (see
../shared/notes/megatron-core-on-cpu.md). Every adaptation lives here, one comment each.
On a machine with CUDA nothing is patched.
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
