"""Benchmark of the CPU optimizer's full mixed-precision step against torch and DeepSpeed.

    python bench/cpu_adam.py [--params N] [--threads T] [--repeats R] [--json]

Everything runs in one process on the same sizes; each figure is the median of R rounds
after one warm-up, every round running each variant once (the machine may be shared:
interleaving spreads disturbances over all variants), with the spread (slowest and
fastest round) under `spread`. Prints one JSON object (with --json, only that).

The full step: 16-bit gradients in, unscale, check for non-finite values, AdamW on fp32
master/m/v, 16-bit working copy out.
- ours: one call of the C++ kernel (megatron.optimizer.CPUAdamW); also in exact-rollback
  mode (snapshots the state it changes) and the arithmetic rollback's own speed.
- ours_bf16_states: m and v in bf16 (fp32 master): 20 bytes per parameter moved.
- ours_bf16_all: m, v and the master in bf16, stochastic rounding: 16 bytes moved.
- torch_composed: the fastest torch ops, all buffers preallocated: copy_ to fp32,
  torch._amp_foreach_non_finite_check_and_unscale_ (unscale + check in one op, what
  torch.amp uses), fused AdamW, copy_ to 16 bits.
- torch_composed_isfinite: the same with mul_ and torch.isfinite(g).all() as the check.
- torch_fused_adamw: torch's fused AdamW on fp32 gradients alone (less work than ours).
- ours_fp32_grad: our kernel on torch_fused_adamw's inputs and outputs (fp32 gradient in,
  no working copy out, scale 1: the same 28 bytes per parameter; ours still checks the
  gradient and sums its squares); `ours_same_work_over_torch_fused` compares the two
  kernels on equal bytes at --threads threads each.
- deepspeed: DeepSpeedCPUAdam in place of the fused AdamW in torch_composed.
- bandwidth_gb_s: torch.add(a, b, out=c) over fp32 buffers (3 x 4 bytes per element).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.optimizer import CPUAdamW, available_isas  # noqa: E402

LR, INV_SCALE = 1e-4, 1.0 / 1024


def seconds_interleaved(steps: dict[str, Callable[[], object]], repeats: int
                        ) -> dict[str, list[float]]:
    """Every time of each step over `repeats` rounds; every round runs each step once, so
    that load from other processes on a shared machine disturbs all of them alike. The
    order is shuffled every round (fixed seed): a step must not always follow the same one,
    since torch's OpenMP threads spin for a while after an op and slow down what follows."""
    for step in steps.values():
        step()  # warm-up: page faults, JIT builds, thread pools
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = random.Random(0)
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


# Bytes each variant reads and writes per parameter: p, m, v read and written in their
# dtypes, the 16-bit gradient read, the 16-bit working copy written.
BYTES_PER_PARAM = {"ours_bf16": 28, "ours_fp16": 28, "ours_bf16_states": 20,
                   "ours_bf16_all": 16, "ours_fp32_grad": 28, "fused": 28}


def fp32_param(n: int, gen: torch.Generator) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(n, generator=gen))


def ours_step(
    n: int, threads: int, dtype: torch.dtype, gen, exact: bool = False, rollback: bool = False,
    state_dtype: torch.dtype = torch.float32, master_dtype: torch.dtype = torch.float32,
    cores: Sequence[int] = (), working_copy: bool = True,
) -> Callable[[], None]:
    """Our full step; with rollback=True the step and then its rollback. cores: pin the
    kernel threads (none: unpinned). working_copy=False: no 16-bit copy out and no loss
    scale (torch's fused AdamW's work, with an fp32 `dtype`)."""
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=LR, weight_decay=0.1, threads=threads,
                   cores=cores, exact_rollback=exact, state_dtype=state_dtype,
                   master_dtype=master_dtype)
    scale = 1024 if working_copy else 1
    grad = (torch.randn(n, generator=gen) * scale).to(dtype)
    out = torch.empty(n, dtype=dtype) if working_copy else None

    def step() -> None:
        opt.step_group(0, grad, inv_scale=1.0 / scale, out=out)
        if rollback:
            opt.rollback_group(0)
        else:
            opt.commit_group(0)

    return step


def composed_step(
    n: int, dtype: torch.dtype, gen, make_optimizer, check: str = "amp"
) -> Callable[[], None]:
    """16-bit grad -> fp32 copy -> unscale+check -> optimizer step -> 16-bit copy.
    check="amp": torch's fused unscale-and-check op; "isfinite": mul_ then
    torch.isfinite(g).all(), the textbook composition."""
    param = fp32_param(n, gen)
    param.grad = torch.empty(n)
    grad16 = (torch.randn(n, generator=gen) * 1024).to(dtype)
    out = torch.empty(n, dtype=dtype)
    found_inf = torch.zeros(1)
    inv_scale = torch.tensor(INV_SCALE)
    opt = make_optimizer(param)

    def unscale_and_check() -> bool:
        if check == "isfinite":
            param.grad.mul_(INV_SCALE)
            return bool(torch.isfinite(param.grad).all())
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inv_scale)
        return found_inf.item() == 0.0

    def step() -> None:
        param.grad.copy_(grad16)
        if unscale_and_check():
            opt.step()
        out.copy_(param)

    return step


def torch_fused(param: torch.nn.Parameter) -> torch.optim.Optimizer:
    return torch.optim.AdamW([param], lr=LR, weight_decay=0.1, fused=True)


def deepspeed_optimizer(param: torch.nn.Parameter):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([param], lr=LR, weight_decay=0.1, adamw_mode=True)


def deepspeed_step(n: int, dtype: torch.dtype, gen) -> tuple[Callable[[], None] | None, str | None]:
    """DeepSpeedCPUAdam in the composed step, or None and why it cannot run."""
    try:
        step = composed_step(n, dtype, gen, deepspeed_optimizer)
        step()  # builds the extension on first use
        return step, None
    except Exception as error:  # noqa: BLE001 - any failure to import or build is the answer
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:300]


def torch_fused_fp32_step(n: int, gen) -> Callable[[], None]:
    param = fp32_param(n, gen)
    param.grad = torch.randn(n, generator=gen)
    return torch_fused(param).step


def triad_step(n: int) -> Callable[[], None]:
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    return lambda: torch.add(a, b, out=c)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--params", type=positive_int, default=20_000_000,
                        help="parameters per step (default 20M)")
    parser.add_argument("--threads", type=positive_int, default=2, help="threads (default 2)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed repetitions")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    n, threads, repeats = args.params, args.threads, args.repeats
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    gen = torch.Generator().manual_seed(0)

    steps = {
        "ours_bf16": ours_step(n, threads, torch.bfloat16, gen),
        "ours_fp16": ours_step(n, threads, torch.float16, gen),
        "ours_bf16_states": ours_step(n, threads, torch.bfloat16, gen,
                                      state_dtype=torch.bfloat16),
        "ours_bf16_all": ours_step(n, threads, torch.bfloat16, gen, state_dtype=torch.bfloat16,
                                   master_dtype=torch.bfloat16),
        "ours_exact": ours_step(n, threads, torch.bfloat16, gen, exact=True),
        "ours_step_rollback": ours_step(n, threads, torch.bfloat16, gen, rollback=True),
        "ours_fp32_grad": ours_step(n, threads, torch.float32, gen, working_copy=False),
        "composed": composed_step(n, torch.bfloat16, gen, torch_fused),
        "composed_isfinite": composed_step(n, torch.bfloat16, gen, torch_fused, "isfinite"),
        "fused": torch_fused_fp32_step(n, gen),
        "triad": triad_step(n),
    }
    deepspeed, deepspeed_error = deepspeed_step(n, torch.bfloat16, gen)
    if deepspeed is not None:
        steps["deepspeed"] = deepspeed
    times = seconds_interleaved(steps, repeats)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: n / s for name, s in seconds.items()}
    spread = {name: [n / max(t), n / min(t)] for name, t in times.items()}
    ours_bf16, ours_fp16 = rate["ours_bf16"], rate["ours_fp16"]
    composed, composed_isfinite, fused = rate["composed"], rate["composed_isfinite"], rate["fused"]
    bandwidth = 12 * rate["triad"] / 1e9

    result = {
        "params": n,
        "threads": threads,
        "repeats": repeats,
        "isa": available_isas()[-1],
        "cpu": platform.processor() or platform.machine(),
        "ours_params_per_s": ours_bf16,
        "ours_bf16_params_per_s": ours_bf16,
        "ours_fp16_params_per_s": ours_fp16,
        "ours_bf16_states_params_per_s": rate["ours_bf16_states"],
        "ours_bf16_all_params_per_s": rate["ours_bf16_all"],
        "ours_exact_rollback_mode_params_per_s": rate["ours_exact"],
        # the rollback alone: the step-then-rollback pair's time minus the step's
        "ours_rollback_params_per_s": n / max(seconds["ours_step_rollback"] - seconds["ours_bf16"], 1e-9),
        "torch_composed_params_per_s": composed,
        "torch_composed_isfinite_params_per_s": composed_isfinite,
        "torch_fused_adamw_params_per_s": fused,
        "deepspeed_params_per_s": rate.get("deepspeed"),
        "deepspeed_error": deepspeed_error,
        "bandwidth_gb_s": bandwidth,
        # 4 reads (p, m, v: 4 B, grad: 2 B) and 4 writes (p, m, v: 4 B, copy: 2 B)
        "ours_gb_s": ours_bf16 * 28 / 1e9,
        "ours_fp32_grad_params_per_s": rate["ours_fp32_grad"],
        "ours_over_torch_fused": ours_bf16 / fused,
        # the two kernels on equal work and bytes (fp32 gradient, no copy out)
        "ours_same_work_over_torch_fused": rate["ours_fp32_grad"] / fused,
        "ours_over_torch_composed": ours_bf16 / composed,
        "ours_over_torch_composed_isfinite": ours_bf16 / composed_isfinite,
        "fp16_over_bf16": ours_fp16 / ours_bf16,
        "bf16_states_over_fp32_states": rate["ours_bf16_states"] / ours_bf16,
        "bf16_all_over_fp32_states": rate["ours_bf16_all"] / ours_bf16,
        "bytes_per_param": BYTES_PER_PARAM,
        "gb_s": {name: rate[name] * b / 1e9 for name, b in BYTES_PER_PARAM.items()},
        "statistic": f"median of {repeats} interleaved rounds",
        "spread": spread,  # params/s of the slowest and the fastest round
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            shown = (f"{value / 1e6:,.0f} M" if key.endswith("params_per_s") and value
                     else value)
            print(f"{key:32s} {shown}")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
