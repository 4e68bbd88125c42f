"""The CPU optimizer's step at the byte limit: bytes per parameter and GB/s of every
kernel variant, beside torch's fused AdamW and plain streams of the same bytes.

    python bench/cpu_adam_variants.py [--params N] [--threads T] [--repeats R]
        [--precisions fp32,bf16_states,bf16_all] [--tunings default,stream_out,...] [--json]

Every variant runs once per round, rounds interleaved (bench/cpu_adam.py's
seconds_interleaved), after one warm-up; each figure is the median of R rounds with the
slowest and fastest round beside it. Variants:
- ours_<precision>[_<tuning>]: the full step (bf16 gradient in, bf16 working copy out) with
  fp32 master/m/v (28 bytes per parameter moved), bf16 m and v (20) or everything in bf16
  with stochastic rounding (16), under one setting of the kernel's speed knobs (TUNINGS;
  results are bit-identical under every one).
- torch_fused_adamw: torch's fused AdamW on fp32 gradients, no check, no copy (28 bytes).
- touch_<precision>[_stream_out]: the kernel's probe (`_cpu_adam.touch`): the same loads
  and stores as the step of that precision, on the same thread pool, without the
  arithmetic: the byte limit of the step's own memory streams.
- torch_rmw_28, torch_copy_28: torch's in-place add over 7 fp32 and copy of 14 bytes per
  parameter: plain streams of 28 bytes per parameter.
GB/s = parameters/s x bytes per parameter (nominal: a cache's write-allocate reads of the
working copy are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_adam import ours_step, positive_int, seconds_interleaved, torch_fused_fp32_step  # noqa: E402
from spread import spread  # noqa: E402

from megatron.optimizer import _cpu_adam as _kernel  # noqa: E402
from megatron.optimizer import available_isas, kernel_tuning, kernel_tuning_setting  # noqa: E402
from megatron.optimizer.worker_pool import shared_pool  # noqa: E402

# state precision -> (state_dtype, master_dtype, bytes moved per parameter)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, 28),
    "bf16_states": (torch.bfloat16, torch.float32, 20),
    "bf16_all": (torch.bfloat16, torch.bfloat16, 16),
}
# Kernel knobs per tuning variant (megatron.optimizer.kernel_tuning); "pinned" pins the
# kernel threads to cores 0..T-1 instead.
TUNINGS: dict[str, dict] = {
    "default": {},
    "stream_out": {"stream_out": True},
    "prefetch_0": {"prefetch": 0},
    "prefetch_512": {"prefetch": 512},
    "prefetch_1024": {"prefetch": 1024},
    "block_8k": {"block": 8192},
    "block_256k": {"block": 262144},
    "pinned": {},
}


def tuned(step: Callable[[], None], knobs: dict) -> Callable[[], None]:
    def run() -> None:
        with kernel_tuning(**knobs):
            step()

    return run


def ours_variants(n: int, threads: int, precisions: list[str], tunings: list[str], gen
                  ) -> dict[str, tuple[int, Callable[[], None]]]:
    """name -> (bytes per parameter, step); the tunings of one precision share buffers."""
    variants = {}
    for precision in precisions:
        state_dtype, master_dtype, nbytes = PRECISIONS[precision]
        base = ours_step(n, threads, torch.bfloat16, gen, state_dtype=state_dtype,
                         master_dtype=master_dtype)
        for name in tunings:
            if name == "pinned":
                step = ours_step(n, threads, torch.bfloat16, gen, state_dtype=state_dtype,
                                 master_dtype=master_dtype, cores=list(range(threads)))
            else:
                step = tuned(base, TUNINGS[name]) if TUNINGS[name] else base
            suffix = "" if name == "default" else f"_{name}"
            variants[f"ours_{precision}{suffix}"] = (nbytes, step)
    return variants


def touch_step(n: int, threads: int, precision: str, stream_out: bool) -> Callable[[], None]:
    """The kernel's probe (`_cpu_adam.touch`): the step's loads and stores of this precision
    (same streams, prefetch and thread pool) without its arithmetic."""
    state_dtype, master_dtype, _ = PRECISIONS[precision]
    p, m, v = torch.zeros(n, dtype=master_dtype), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    grad, out = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    fmt = _kernel.StateFormat()
    fmt.master_dtype, fmt.state_dtype = (_kernel.BF16 if d == torch.bfloat16 else _kernel.F32
                                         for d in (master_dtype, state_dtype))
    pool = shared_pool(threads)

    def step() -> None:
        with kernel_tuning(stream_out=stream_out):
            _kernel.touch(p=p.data_ptr(), m=m.data_ptr(), v=v.data_ptr(), grad=grad.data_ptr(),
                          grad_dtype=_kernel.BF16, out=out.data_ptr(), out_dtype=_kernel.BF16,
                          n=n, pool=pool, format=fmt)

    return step


def stream_references(n: int, threads: int, precisions: list[str]
                      ) -> dict[str, tuple[int, Callable[[], None]]]:
    """The byte limit: each precision's loads and stores alone (touch_<precision>, with
    and without streaming stores of the copy), and torch's plain streams of 28 bytes per
    parameter (in-place add over 7 fp32, copy of 14 bytes)."""
    refs = {}
    for precision in precisions:
        nbytes = PRECISIONS[precision][2]
        refs[f"touch_{precision}"] = (nbytes, touch_step(n, threads, precision, False))
        refs[f"touch_{precision}_stream_out"] = (nbytes, touch_step(n, threads, precision, True))
    rmw = torch.zeros(7 * n)
    src, dst = torch.zeros(14 * n, dtype=torch.uint8), torch.empty(14 * n, dtype=torch.uint8)
    refs["torch_rmw_28"] = (28, lambda: rmw.add_(1.0))
    refs["torch_copy_28"] = (28, lambda: dst.copy_(src))
    return refs


def names(text: str, known: dict) -> list[str]:
    chosen = [t for t in text.split(",") if t]
    unknown = [t for t in chosen if t not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names from {', '.join(known)}")
    return chosen


def summarize(n: int, variants: dict[str, tuple[int, Callable[[], None]]],
              times: dict[str, list[float]]) -> dict[str, dict]:
    out = {}
    for name, (nbytes, _) in variants.items():
        rates = [n / t for t in times[name]]
        out[name] = {"bytes_per_param": nbytes, "params_per_s": spread(rates),
                     "gb_s": spread([r * nbytes / 1e9 for r in rates])}
    return out


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """Medians over medians: each tuning over its precision's default, the default
    precisions over each other and over torch, ours over its own loads and stores alone
    (the faster touch probe)."""
    med = {name: r["params_per_s"]["median"] for name, r in results.items()}
    out = {}
    for name in med:
        for precision in PRECISIONS:
            base = f"ours_{precision}"
            if name.startswith(base + "_") and base in med:
                out[f"{name}_over_default"] = med[name] / med[base]
    if "ours_fp32" in med and "torch_fused_adamw" in med:
        out["ours_over_torch_fused"] = med["ours_fp32"] / med["torch_fused_adamw"]
    for precision in ("bf16_states", "bf16_all"):
        if f"ours_{precision}" in med and "ours_fp32" in med:
            out[f"{precision}_over_fp32_states"] = med[f"ours_{precision}"] / med["ours_fp32"]
    for precision in PRECISIONS:
        limit = max(med.get(f"touch_{precision}{s}", 0.0) for s in ("", "_stream_out"))
        if f"ours_{precision}" in med and limit:
            out[f"ours_{precision}_over_its_touch"] = med[f"ours_{precision}"] / limit
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=positive_int, default=20_000_000)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=9)
    parser.add_argument("--precisions", type=lambda t: names(t, PRECISIONS),
                        default=list(PRECISIONS))
    parser.add_argument("--tunings", type=lambda t: names(t, TUNINGS), default=list(TUNINGS))
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    n = args.params
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    variants = ours_variants(n, args.threads, args.precisions, args.tunings, gen)
    variants["torch_fused_adamw"] = (28, torch_fused_fp32_step(n, gen))
    variants.update(stream_references(n, args.threads, args.precisions))
    times = seconds_interleaved({name: step for name, (_, step) in variants.items()},
                                args.repeats)
    results = summarize(n, variants, times)
    report = {
        "params": n, "threads": args.threads, "repeats": args.repeats,
        "isa": available_isas()[-1], "default_tuning": kernel_tuning_setting(),
        "statistic": f"median, min, max of {args.repeats} interleaved rounds",
        "variants": results, "ratios": ratios(results),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if not args.json:
        for name, r in results.items():
            p, g = r["params_per_s"], r["gb_s"]
            print(f"{name:34s} {r['bytes_per_param']:3d} B  {p['median'] / 1e6:7,.0f} Mparam/s "
                  f"({p['min'] / 1e6:,.0f}-{p['max'] / 1e6:,.0f})  {g['median']:5.1f} GB/s "
                  f"({g['min']:.1f}-{g['max']:.1f})")
        for key, value in report["ratios"].items():
            print(f"{key:44s} {value:.3f}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
