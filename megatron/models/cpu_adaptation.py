"""megatron-core on this project's two device paths: the same setup, and what a host without
CUDA needs besides.

megatron-core 0.16.1 assumes CUDA in two places on the model path that this project uses
(embedding, transformer layers with the local spec, rotary embedding, dot-product
attention, output layer):
- `torch.cuda.current_device()` places tensors (rotary_pos_embedding.py, the global memory
  buffer in core/utils.py that attention uses);
- attention and embedding dropout run inside the CUDA RNG tracker's `fork()`, which needs
  Megatron's named RNG states (`model-parallel-rng`, ...) and reads and writes the CUDA
  generator's state.
`set_up_megatron_core` seeds the tracker exactly as Megatron-LM does on a GPU
(`model_parallel_cuda_manual_seed(--seed)`) on both paths. Without CUDA, it first stands a
host generator in for the CUDA generator and answers "cpu" for the current device: the
tracker itself, its named states and every `fork()` are megatron-core's own, so a path that
forgets the setup fails on the CPU with the error CUDA gives ("cuda rng state
model-parallel-rng is not added"). The rest of what we use (indexed datasets, GPTDataset,
OptimizerParamScheduler, parallel_state with gloo) needs no change, and the project replaces
megatron-core's pipeline schedules and offloading optimizer instead of adapting them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable

import torch

# The generator that plays the CUDA device's default generator on a host without CUDA.
_HOST_DEVICE_GENERATOR = torch.Generator()
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


def _host_get_rng_state(device: object = "cuda", clone: bool = False,
                        graph_safe: bool = False) -> torch.Tensor:
    return _HOST_DEVICE_GENERATOR.get_state()


def _host_set_rng_state(new_state: torch.Tensor, device: object = -1,
                        graph_safe: bool = False) -> None:
    _HOST_DEVICE_GENERATOR.set_state(new_state)


def _host_manual_seed(seed: int) -> None:
    _HOST_DEVICE_GENERATOR.manual_seed(int(seed))


def adapt_megatron_core_for_host() -> None:
    """What a host without CUDA needs besides the common setup. Idempotent."""
    global _adapted
    if torch.cuda.is_available():
        raise RuntimeError("adapt_megatron_core_for_host: CUDA is available; the GPU path "
                           "runs megatron-core unchanged")
    if _adapted:
        return
    from megatron.core.tensor_parallel import random as mcore_random

    # rotary_pos_embedding.py, core/utils.py and dot_product_attention.py place tensors on
    # `torch.cuda.current_device()`, which raises on a CPU build: answer "cpu" instead.
    torch.cuda.current_device = _cpu_current_device
    # The RNG tracker reads and writes the CUDA generator through these: a host generator
    # plays it (torch's own CPU generator stays the model's and the data's).
    torch.cuda.get_rng_state = _host_get_rng_state
    torch.cuda.manual_seed = _host_manual_seed
    mcore_random._get_cuda_rng_state = _host_get_rng_state
    mcore_random._set_cuda_rng_state = _host_set_rng_state
    _adapted = True


def seed_rng_tracker(seed: int) -> None:
    """Megatron-LM's `_set_random_seed` on a GPU: megatron-core's tracker with its named
    states (data-parallel, model-parallel, expert-parallel) from `seed`. Tensor and expert
    parallel sizes are 1 here, so their ranks are 0 on every process."""
    from megatron.core.tensor_parallel import random as mcore_random

    seed_fn = mcore_random.model_parallel_cuda_manual_seed
    # the keywords this megatron-core release knows (0.16 to 0.19 differ)
    known = inspect.signature(seed_fn).parameters
    options = {k: v for k, v in dict(tp_rank=0, ep_rank=0, etp_rank=0,
                                     force_reset_rng=True).items() if k in known}
    seed_fn(seed, **options)


def rng_tracker_states() -> set[str]:
    """The names of the states megatron-core's tracker holds (empty before the setup)."""
    from megatron.core.tensor_parallel import random as mcore_random

    return set(mcore_random.get_cuda_rng_tracker().get_states())


def set_up_megatron_core(kind: str, seed: int) -> None:
    """The device-side setup of megatron-core for a process that trains on `kind`
    ("cuda" or "cpu"): the same on both, with the host adaptation first on the CPU."""
    if kind == "cpu":
        adapt_megatron_core_for_host()
    seed_rng_tracker(seed)
