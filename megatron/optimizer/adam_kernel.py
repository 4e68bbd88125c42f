"""The C++ AdamW kernel (csrc/, bound as megatron.optimizer._cpu_adam) as Python calls:
one step, its inverse and its fused correction over a range of a group's p, m, v, with
the constants of one optimizer (betas, eps, storage formats, rounding layout, thread
pool, ISA) bound once. What a step changes is recorded in a StepRecord, which is all its
inverse needs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

try:
    from megatron.optimizer import _cpu_adam as _kernel
    from megatron.optimizer.worker_pool import shared_pool
except ImportError as error:  # the extension is built in place by `make setup`
    if "CPU_ADAM_" in str(error):  # built, but a tuning variable is invalid
        raise ImportError(f"the CPU optimizer's tuning environment is invalid: {error}") from error
    raise ImportError(
        "megatron.optimizer._cpu_adam is not built: run `python setup.py build_ext --inplace` "
        f"(or `make setup`) in the repository root ({error})"
    ) from error

from megatron.optimizer.rounding import ElementRun, kernel_runs  # noqa: E402

DTYPE_CODES = {torch.float32: _kernel.F32, torch.float16: _kernel.F16, torch.bfloat16: _kernel.BF16}
# p, m and v of one group as the kernel reads them (host memory, contiguous)
GroupTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepRecord:
    """Everything the inverse of a step needs; the gradient must not change until then."""

    grad: torch.Tensor
    out: torch.Tensor | None
    inv_scale: float
    lr: float
    weight_decay: float
    step: int
    clip: float = 1.0  # gradient clip factor the step used (after the unscaling)


def available_isas() -> list[str]:
    """Kernels this CPU can run, least to most capable; 'auto' picks the last."""
    return list(_kernel.available_isas())


def kernel_tuning_setting() -> dict:
    """The kernel's speed knobs: prefetch (elements ahead, 0: none), stream_out
    (non-temporal stores of the working copy), block (elements per thread block),
    static_split (each worker first takes its own contiguous share of a call's blocks, the
    same share on every call). They start from CPU_ADAM_PREFETCH, CPU_ADAM_STREAM_OUT,
    CPU_ADAM_BLOCK, CPU_ADAM_STATIC_SPLIT; results never depend on them."""
    return dict(_kernel.get_tuning())


@contextlib.contextmanager
def kernel_tuning(prefetch: int | None = None, stream_out: bool | None = None,
                  block: int | None = None, static_split: bool | None = None) -> Iterator[dict]:
    """Run the enclosed kernel calls with these knobs (None: unchanged), then restore
    the previous ones. Process-wide: meant for benchmarks, not for concurrent steps."""
    previous = _kernel.set_tuning(prefetch=prefetch, stream_out=stream_out, block=block,
                                  static_split=static_split)
    try:
        yield kernel_tuning_setting()
    finally:
        _kernel.set_tuning(**previous)


def usable_cores() -> list[int]:
    """The cores this process may run on (what `cores=` may name)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_flat(name: str, tensor: torch.Tensor, numel: int, dtypes: Sequence[torch.dtype]) -> None:
    """One-line error unless `tensor` is a contiguous host tensor of `numel` elements of
    one of `dtypes` (what the kernel may read through a pointer)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be in host memory, got device {tensor.device}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {names}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")


def check_clip(clip: float) -> None:
    if not 0.0 < clip <= 1.0:
        raise ValueError(f"clip={clip} must lie in (0, 1]")


def check_gradient(
    grad: torch.Tensor,
    inv_scale: float = 1.0,
    threads: int = 1,
    isa: str = "auto",
    cores: Sequence[int] = (),
) -> tuple[bool, float]:
    """Unscale and check a flat gradient without updating anything (the synchronous
    schedule's first pass). Returns (finite, sum of squares of the unscaled gradient)."""
    check_flat("grad", grad, grad.numel(), list(DTYPE_CODES))
    return _kernel.check(
        grad=grad.data_ptr(), grad_dtype=DTYPE_CODES[grad.dtype], n=grad.numel(),
        inv_scale=float(inv_scale), pool=shared_pool(int(threads), cores), isa=isa,
    )


class AdamKernel:
    """The kernel with one optimizer's constants: betas, eps, the dtypes of the master
    and of the moments, the stochastic rounding's element layout (`runs[g]` per group)
    and seed, the thread pool (the process's shared one for `threads` pinned to `cores`)
    and the ISA. Every call names the group, the range [lo, hi) of it, its p, m, v and
    the StepRecord of the step concerned."""

    def __init__(self, betas: tuple[float, float], eps: float, master_dtype: torch.dtype,
                 state_dtype: torch.dtype, runs: Sequence[Sequence[ElementRun]],
                 stochastic_rounding: bool, rounding_seed: int, threads: int,
                 cores: Sequence[int], isa: str) -> None:
        self.betas, self.eps = betas, eps
        self.master_dtype, self.state_dtype = master_dtype, state_dtype
        self.runs = [tuple(r) for r in runs]
        self.stochastic_rounding, self.rounding_seed = stochastic_rounding, rounding_seed
        self.pool, self.isa = shared_pool(threads, cores), isa

    def rounding_rows(self, group: int, lo: int, hi: int, step: int) -> list[list[int]] | None:
        """The stochastic-rounding rows for elements [lo, hi) of the group (None: the
        master rounds to nearest even, or is fp32)."""
        if self.master_dtype != torch.bfloat16 or not self.stochastic_rounding:
            return None
        return kernel_runs(self.runs[group], lo, hi, self.rounding_seed, step)

    def args(self, group: int, tensors: GroupTensors, r: StepRecord, lo: int, hi: int,
             snapshot: torch.Tensor | None, base: int = 0) -> dict:
        """The kernel's arguments for elements [lo, hi) (`snapshot`: that range's block).
        `base`: the group's element that p, m and v begin at (a chunk of the group read
        from disk); the gradient and the working copy are the whole group's."""
        fmt = _kernel.StateFormat()
        fmt.master_dtype = DTYPE_CODES[self.master_dtype]
        fmt.state_dtype = DTYPE_CODES[self.state_dtype]
        fmt.runs = self.rounding_rows(group, lo, hi, r.step) or []

        def at(t: torch.Tensor, first: int = 0) -> int:
            return t.data_ptr() + (lo - first) * t.element_size()
        p, m, v = tensors
        return dict(
            p=at(p, base), m=at(m, base), v=at(v, base), grad=at(r.grad),
            grad_dtype=DTYPE_CODES[r.grad.dtype],
            out=0 if r.out is None else at(r.out),
            out_dtype=_kernel.NONE if r.out is None else DTYPE_CODES[r.out.dtype],
            snapshot=0 if snapshot is None else snapshot.data_ptr(), n=hi - lo,
            lr=r.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
            weight_decay=r.weight_decay, step=r.step, inv_scale=r.inv_scale,
            pool=self.pool, isa=self.isa, clip=r.clip, format=fmt,
        )

    @staticmethod
    def step(call: dict) -> tuple[bool, float]:
        """One step; (finite, sum of squares of the unscaled gradient)."""
        return _kernel.step(**call)

    @staticmethod
    def undo(call: dict) -> None:
        """The step's inverse (from the snapshot when the arguments name one)."""
        _kernel.undo(**call)

    @staticmethod
    def correct(call: dict, undo_clip: float) -> None:
        """Replace a step made with clip `undo_clip` by the one with the arguments' clip."""
        _kernel.correct(**call, undo_clip=undo_clip)
