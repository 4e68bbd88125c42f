"""Host memory tier benchmark: prefetch and gradient offload throughput, and overlap.

    python bench/offload.py --json [--device auto|cpu|cuda] [--stage-mb 64] [--repeats 5]

For one stage-sized buffer it measures, in the same run:
  * plain_copy: a synchronous copy on the caller's thread (on CUDA: pageable .to(device))
    -- the baseline;
  * prefetch: the store's shared-memory segment -> a device double-buffer half on the
    H2D stream (ParamSlots.prefetch, timed until its ready event);
  * offload_fp32 / offload_bf16: accumulated bf16 gradients -> fp32 gradients on the host,
    either upcast on the device then a 4-byte transfer, or a 2-byte transfer then the
    upcast on the host (Deep Optimizer States 4.1); reported as GB/s of fp32 gradients;
  * overlap: a compute load alone, the prefetch alone, and both together; from the events
    of the together run, the fraction of the copy's time spent while compute ran
    (1.0 = the copy ran entirely under compute).
Figures are medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.offload.device import DeviceLayer, get_device  # noqa: E402
from megatron.offload.grad_offload import GradientOffloader  # noqa: E402
from megatron.offload.host_memory import HostBufferPool  # noqa: E402
from megatron.offload.param_store import ParameterStore  # noqa: E402
from megatron.offload.prefetch import ParamSlots  # noqa: E402


def median_seconds(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median wall time of each run; the runs alternate so load drift hits all alike."""
    for run in runs.values():
        run()  # warm-up: first touches, thread start, allocator
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def compute_load(dev: DeviceLayer, weights: torch.Tensor, steps: int) -> None:
    with dev.on(dev.compute_stream):
        acc = weights
        for _ in range(steps):
            acc = torch.tanh(acc @ weights / weights.shape[0])
    dev.compute_stream.synchronize()


def measure(dev: DeviceLayer, stage_bytes: int, repeats: int, compute_steps: int) -> dict:
    numel = stage_bytes // 2  # bf16 parameters
    gbytes = numel * 2 / 1e9
    store = ParameterStore(job_id=f"bench-{uuid.uuid4().hex}", rank=0)
    try:
        segment = store.create((0, 0), numel, torch.bfloat16)
        segment.write(torch.randn(numel).to(torch.bfloat16), version=1)
        buf = ParamSlots(dev, budget_bytes=2 * numel * 2, dtype=torch.bfloat16)
        plain_dst = dev.empty(numel, torch.bfloat16)

        def plain_copy() -> None:
            plain_dst.copy_(segment.params)
            dev.synchronize()

        def prefetch() -> None:
            slot = buf.prefetch((0, 0), segment.params)
            slot.ready.wait()
            buf.release(slot)

        pool = HostBufferPool(dev, capacity_bytes=3 * numel * 4)
        grads = dev.empty(numel, torch.bfloat16).normal_()
        fp32_path = GradientOffloader(dev, pool, host_dtype=torch.float32)
        bf16_path = GradientOffloader(dev, pool, host_dtype=torch.bfloat16)

        def offload_fp32() -> None:
            ready = fp32_path.offload((0, 0), grads)
            ready.wait()
            ready.release()

        def offload_bf16() -> None:
            ready = bf16_path.offload((0, 0), grads)
            ready.wait()
            host32 = pool.acquire(numel, torch.float32)
            host32.copy_(ready.host)  # the upcast the CPU optimizer then needs
            pool.release(host32)
            ready.release()

        side = 1024 if dev.kind == "cuda" else 384
        weights = dev.empty(side * side, torch.float32).normal_().view(side, side)

        def compute() -> None:
            compute_load(dev, weights, compute_steps)

        overlaps: list[float] = []

        def together() -> None:
            copy_started = dev.h2d_stream.record_event()
            slot = buf.prefetch((0, 0), segment.params)
            compute_started = dev.compute_stream.record_event()
            compute_load(dev, weights, compute_steps)
            compute_ended = dev.compute_stream.record_event()
            slot.ready.wait()
            buf.release(slot)
            copy = (copy_started.time_s(), slot.ready.time_s())
            shared = min(copy[1], compute_ended.time_s()) - max(copy[0], compute_started.time_s())
            overlaps.append(max(shared, 0.0) / (copy[1] - copy[0]))

        t = median_seconds(
            {
                "plain_copy": plain_copy,
                "prefetch": prefetch,
                "offload_fp32": offload_fp32,
                "offload_bf16": offload_bf16,
                "compute": compute,
                "together": together,
            },
            repeats,
        )
    finally:
        store.close()
    return {
        "stage_bytes": numel * 2,
        "plain_copy_GBps": gbytes / t["plain_copy"],
        "prefetch_GBps": gbytes / t["prefetch"],
        "offload_fp32_GBps": 2 * gbytes / t["offload_fp32"],
        "offload_bf16_then_host_upcast_GBps": 2 * gbytes / t["offload_bf16"],
        "pinned_host_buffers": pool.pinned,
        "compute_s": t["compute"],
        "prefetch_s": t["prefetch"],
        "together_s": t["together"],
        "copy_time_under_compute_fraction": statistics.median(overlaps),
        "faster_grad_host_dtype": "fp32" if t["offload_fp32"] <= t["offload_bf16"] else "bf16",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--stage-mb", type=float, default=64.0, help="stage size in MB (bf16)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--compute-steps", type=int, default=20, help="matmuls in the load")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.stage_mb <= 0:
        parser.error(f"--stage-mb={args.stage_mb}: expected a positive size in MB")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: expected at least 1")
    if args.compute_steps < 1:
        parser.error(f"--compute-steps={args.compute_steps}: expected at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: CUDA is not available on this machine")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with get_device(None if args.device == "auto" else args.device) as dev:
        result = {
            "device": dev.kind,
            **measure(dev, int(args.stage_mb * 1e6), args.repeats, args.compute_steps),
        }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:40s} {value:.3f}" if isinstance(value, float) else f"{key:40s} {value}")


if __name__ == "__main__":
    main()
