#!/usr/bin/env python3
"""Fit the paper-v100 profile's two free figures to SysX Fig. 10 and 11 by grid search.

The free figures: the node's CPU Adam rate (`cpu_optimizer_params_per_s`; only its ratio
to the GPU's achieved flops matters to speedups, and the GPU side is fixed from published
V100 figures) and the host time per forward/backward pass (`pass_overhead_s`). For every
grid point, `bench/pipeline_sweep.py`'s sweep runs on the profile with those two values; the
objective is the RMS relative error of the Fig. 10 and Fig. 11 averages, total and GPU
pipeline speedup (16 points). Prints one JSON object: every grid point's objective, the
best point, and its Fig. 10/11/12/14 residuals. Schedules are built once and reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pipeline_sweep import PAPER_MODELS, sweep  # noqa: E402
from megatron.schedules.hardware import get_hardware  # noqa: E402

FITTED_METRICS = ("speedup_total", "speedup_gpu_pipeline")


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def objective(result: dict) -> float:
    errors = [point[metric]["rel_error"]
              for figure in ("fig10_mbs_scaling", "fig11_gbs_scaling")
              for points in [next(v for k, v in result[figure].items() if k.startswith("average"))]
              for point in points.values() for metric in FITTED_METRICS]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-rates", type=_floats, default=_floats("1e9,1.5e9,2e9,2.5e9,3e9,4e9"),
                        help="CPU Adam rates of the node to try, parameters/s")
    parser.add_argument("--pass-overheads", type=_floats, default=_floats("0,0.01,0.02,0.05,0.1"),
                        help="host seconds per forward/backward pass to try")
    parser.add_argument("--models", default=",".join(PAPER_MODELS))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    base = get_hardware("paper-v100")
    started = time.perf_counter()
    grid = []
    best = None
    for rate in args.cpu_rates:
        for overhead in args.pass_overheads:
            hardware = dataclasses.replace(base, cpu_optimizer_params_per_s=rate,
                                           pass_overhead_s=overhead)
            result = sweep(hardware, models, extras=False)
            point = {"cpu_optimizer_params_per_s": rate, "pass_overhead_s": overhead,
                     "rms_rel_error": round(objective(result), 4),
                     "max_rel_error_vs_paper": result["max_rel_error_vs_paper"]}
            grid.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)
            if best is None or point["rms_rel_error"] < best["rms_rel_error"]:
                best = point
    hardware = dataclasses.replace(base, cpu_optimizer_params_per_s=best["cpu_optimizer_params_per_s"],
                                   pass_overhead_s=best["pass_overhead_s"])
    result = sweep(hardware, models)
    for figure in ("fig10_mbs_scaling", "fig11_gbs_scaling"):
        result[figure].pop("runs")
    print(json.dumps({"objective": "RMS relative error, Fig. 10 and 11 averages, "
                                   + " and ".join(FITTED_METRICS),
                      "grid": grid, "best": best, "best_residuals": result,
                      "wall_seconds": round(time.perf_counter() - started, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
