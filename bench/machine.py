"""What a benchmark reports about the machine it ran on, in its JSON."""

from __future__ import annotations

import os
import platform
import statistics
import time


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine(**extra: object) -> dict:
    """The CPU, its cores and the Python version, with `extra` (load averages, ...)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), **extra}


def relative_spread(values: list[float]) -> float:
    """(max - min) / median: 0 when every measurement gave the same."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def fixed_work_rate(seconds: float = 2.0) -> float:
    """Matmuls per second of one fixed 512 x 512 fp32 product on one thread: the median
    over `seconds` of them (the machine's speed now, for the drift between profiles)."""
    import torch  # here: the benches that only describe the machine load no torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times)
