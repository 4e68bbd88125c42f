"""What a benchmark reports about the machine it ran on, in its JSON."""

from __future__ import annotations

import os
import platform


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
