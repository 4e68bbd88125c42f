"""How the benchmarks summarise repeated measurements: the median and the range."""

from __future__ import annotations

import statistics


def spread(values: list[float], quartiles: bool = False) -> dict:
    """Median, min and max; quartiles=True adds the first and third quartiles (q1, q3:
    the middle half of the values lies between them) and the count."""
    out = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    if quartiles:
        q1, _, q3 = (statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1
                     else (values[0],) * 3)
        out.update(q1=q1, q3=q3, samples=len(values))
    return out
