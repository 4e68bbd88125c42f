#!/usr/bin/env python3
"""Parameters between nodes, simulated on the paper's testbed: the exposed time per
iteration of pushing every stage's new parameters to the nodes that read them, blocking
after the whole step (every rank's main thread, before its next iteration) against per
stage on a thread of its own while the next iteration runs (the runtime's way).

SysX's 8-node setting (4 V100 per node, one 200 Gb/s HDR link per node, the paper-v100
hardware profile): the 88B and 110B models, decoupled schedule, 2 forward stages per GPU,
micro-batch 2, global batch 16 x nodes, sequence lengths 1024 and 2048. The simulation is
deterministic: one run per configuration. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pipeline_sweep import GPUS_PER_NODE, PAPER_MODELS, paper_schedule  # noqa: E402
from megatron.config.presets import get_preset  # noqa: E402
from megatron.schedules import derived_costs, validate  # noqa: E402
from megatron.schedules.distribution import (  # noqa: E402
    DISTRIBUTION_MODES,
    simulate_distribution,
)

HARDWARE = "paper-v100"
MICRO_BATCH = 2


def run(model: str, seq_length: int) -> dict:
    nodes = PAPER_MODELS[model]
    schedule = paper_schedule("decoupled", model, nodes, MICRO_BATCH, 16 * nodes)
    costs = derived_costs(schedule, get_preset(model), HARDWARE, MICRO_BATCH, seq_length)
    report = validate(schedule)
    modes = {mode: simulate_distribution(schedule, costs, GPUS_PER_NODE, mode, report)
             for mode in DISTRIBUTION_MODES}
    blocking, per_stage = modes["blocking"], modes["per-stage"]
    return {
        "model": model, "nodes": nodes, "seq_length": seq_length,
        "pushes_per_iteration": len(per_stage.transfers),
        "link_time_s": round(per_stage.link_time, 3),
        "iteration_s": {mode: round(r.iteration_time, 3) for mode, r in modes.items()},
        "exposed_distribution_s": {mode: round(r.exposed_time, 3) for mode, r in modes.items()},
        "speedup_per_stage_over_blocking": round(blocking.iteration_time
                                                 / per_stage.iteration_time, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="88b,110b")
    args = parser.parse_args(argv)
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PAPER_MODELS or PAPER_MODELS[m] == 1]
    if unknown:
        parser.exit(2, f"param_distribution.py: error: --models {','.join(unknown)}: expected "
                       f"multi-node models of {','.join(PAPER_MODELS)}\n")
    started = time.perf_counter()
    rows = [run(model, seq) for model in models for seq in (1024, 2048)]
    print(json.dumps({"hardware": HARDWARE, "micro_batch_size": MICRO_BATCH, "runs": rows,
                      "wall_seconds": round(time.perf_counter() - started, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
