"""How the benchmarks summarise repeated measurements: the median and the range."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
