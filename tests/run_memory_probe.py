"""Test harness: train through the library's `train()` and record what each rank holds.

    torchrun --nproc-per-node N tests/run_memory_probe.py --out-dir DIR [pretrain_llama.py flags]

Writes DIR/metrics.jsonl (the device layer's peaks by category) and DIR/rank_R.json: the
process's private host memory (RssAnon) before training and after the last iteration, the
bytes of the shared-memory segments this rank created (owned stages and replicas), and,
after the last iteration, the project's books (the optimizer's state bytes, what the
gradient pool holds, the device layer's buffers) beside the kernel's view of the same
tensors (their resident bytes, megatron/common/process_memory.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.host_memory import storage_spans  # noqa: E402
from megatron.common.process_memory import memory_status, resident_bytes  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.training import train  # noqa: E402

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def books_and_residency(pipeline) -> tuple[dict, dict]:
    """What the runtime's books say it holds, and what the kernel says of those tensors."""
    adam = pipeline.cpu_adam
    states = [t for g in range(adam.num_groups) for t in adam.states(g)]
    pool, device = pipeline.buffers.host_pool, pipeline.device
    books = {"optimizer_states": adam.host_state_bytes(), "host_gradients": pool.allocated_bytes,
             "device_buffers": device.device_bytes}
    resident = {name: resident_bytes(storage_spans(tensors)) for name, tensors in (
        ("optimizer_states", states), ("host_gradients", pool.buffers()),
        ("device_buffers", device.live_buffers()))}
    return books, resident


def main() -> int:
    # glibc keeps freed heap pages of transient tensors resident; with a fixed mmap
    # threshold they go back to the system, so RssAnon shows what the process holds.
    # Set here (MALLOC_MMAP_THRESHOLD_ is read only when a process starts).
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out-dir", required=True)
    harness, rest = own.parse_known_args()
    run = parse_args(rest).evolve(
        logging={"metrics_file": os.path.join(harness.out_dir, "metrics.jsonl")})
    dist_info = initialize_distributed()
    probe: dict = {"rss_anon_before": memory_status()["anon"]}

    def watch(step) -> None:
        probe["rss_anon_built"] = memory_status()["anon"]
        original = step.step

        def step_and_measure(*a, **kw):
            result = original(*a, **kw)
            store = step.pipeline.store
            probe["rss_anon_after"] = memory_status()["anon"]
            probe.setdefault("rss_anon_steps", []).append(probe["rss_anon_after"])
            probe["created_segment_bytes"] = sum(
                os.path.getsize(s.path) for s in store._segments.values() if s.owner)
            probe["books"], probe["resident"] = books_and_residency(step.pipeline)
            return result
        step.step = step_and_measure

    try:
        train(run, dist_info, on_step=watch)
    finally:
        shutdown_distributed()
    with open(os.path.join(harness.out_dir, f"rank_{dist_info.rank}.json"), "w") as f:
        json.dump(probe, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
