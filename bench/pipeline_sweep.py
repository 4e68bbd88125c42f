#!/usr/bin/env python3
"""Speedup of the decoupled (SysX) schedule over Mobius in simulation, SysX Fig. 10 and 11.

For each LLaMA-2 model of SysX Table 2 on its number of nodes (4 V100 per node, the
paper-v100 hardware profile), simulates one iteration of Mobius (interleaved AFAB,
coupled, synchronized CPU optimizer) and of the decoupled schedule (d backward stages per
forward stage, per-stage CPU optimizer overlapped with the backward passes), with 2
forward stages per GPU and sequence length 1024, while
- Fig. 10: the micro-batch size (MBS) varies over 1, 2, 4, 8 at a global batch of
  16 x nodes;
- Fig. 11: the global batch (GBS) grows by 1, 2, 3, 4 times 8 x nodes at MBS 2.
Speedups: total (iteration time), GPU pipeline (time until the last backward ends) and
CPU optimizer (exposed optimizer time). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.presets import get_preset  # noqa: E402
from megatron.schedules import Schedule, build_schedule, derived_costs, simulate  # noqa: E402
from megatron.schedules.generators import RECOMPUTE_BACKWARD_RATIO  # noqa: E402

# SysX Table 2: model -> nodes.
PAPER_MODELS = {"10b": 1, "19b": 1, "30b": 2, "40b": 2, "52b": 4, "69b": 4, "88b": 8, "110b": 8}
GPUS_PER_NODE = 4
STAGES_PER_GPU = 2
# Backward + recompute is about 3x the forward: 3 backward stages per forward stage make
# a backward stage about as long as a forward one (SysX 3.1).
BACKWARD_SPLIT = 3


def paper_schedule(name: str, model: str, nodes: int, micro_batch_size: int,
                   global_batch: int) -> Schedule:
    """Schedule `name` for `model` on `nodes` nodes of the paper's testbed: 2 forward stages
    per GPU, even layers, d = BACKWARD_SPLIT for the decoupled schedule (1 otherwise)."""
    preset = get_preset(model)
    ranks = GPUS_PER_NODE * nodes
    stages = STAGES_PER_GPU * ranks
    partition = [preset.num_layers // stages] * stages
    partition[-1] += preset.num_layers - sum(partition)
    split = BACKWARD_SPLIT if name == "decoupled" else 1
    return build_schedule(name, ranks, stages, split, global_batch // micro_batch_size,
                          partition, backward_ratio=RECOMPUTE_BACKWARD_RATIO)


def run_pair(model: str, nodes: int, micro_batch_size: int, global_batch: int,
             seq_length: int) -> dict:
    preset = get_preset(model)
    ranks = GPUS_PER_NODE * nodes
    stages = STAGES_PER_GPU * ranks
    micro_batches = global_batch // micro_batch_size
    results = {}
    for name in ("mobius", "decoupled"):
        schedule = paper_schedule(name, model, nodes, micro_batch_size, global_batch)
        costs = derived_costs(schedule, preset, "paper-v100", micro_batch_size, seq_length)
        results[name] = simulate(schedule, costs)
    mobius, decoupled = results["mobius"], results["decoupled"]
    return {
        "model": model, "nodes": nodes, "ranks": ranks, "forward_stages": stages,
        "mbs": micro_batch_size, "gbs": global_batch, "micro_batches": micro_batches,
        "mobius": {"iteration_s": mobius.iteration_time, "bubble_ratio": mobius.mean_bubble_ratio,
                   "exposed_optimizer_s": mobius.exposed_optimizer_time},
        "decoupled": {"iteration_s": decoupled.iteration_time,
                      "bubble_ratio": decoupled.mean_bubble_ratio,
                      "exposed_optimizer_s": decoupled.exposed_optimizer_time},
        "speedup_total": mobius.iteration_time / decoupled.iteration_time,
        "speedup_gpu_pipeline": mobius.compute_end / decoupled.compute_end,
        "speedup_cpu_optimizer": mobius.exposed_optimizer_time
        / max(decoupled.exposed_optimizer_time, 1e-9),
    }


def _averages(rows: list[dict], key: str) -> dict:
    table = {}
    for value in sorted({row[key] for row in rows}):
        chosen = [row for row in rows if row[key] == value]
        table[str(value)] = {
            metric: round(sum(row[metric] for row in chosen) / len(chosen), 3)
            for metric in ("speedup_total", "speedup_gpu_pipeline", "speedup_cpu_optimizer")
        }
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PAPER_MODELS),
                        help="comma-separated presets from SysX Table 2")
    parser.add_argument("--seq-length", type=int, default=1024)
    args = parser.parse_args(argv)
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PAPER_MODELS]
    if unknown:
        parser.exit(2, f"pipeline_sweep.py: error: --models {','.join(unknown)}: expected "
                       f"some of {','.join(PAPER_MODELS)}\n")
    started = time.perf_counter()
    mbs_rows, gbs_rows = [], []
    for model in models:
        nodes = PAPER_MODELS[model]
        for mbs in (1, 2, 4, 8):
            mbs_rows.append(run_pair(model, nodes, mbs, 16 * nodes, args.seq_length))
        for factor in (1, 2, 3, 4):
            row = run_pair(model, nodes, 2, 8 * nodes * factor, args.seq_length)
            row["gbs_factor"] = factor
            gbs_rows.append(row)
    print(json.dumps({
        "hardware": "paper-v100 (simulated: 4 x V100 32 GB per node, PCIe Gen3 x16, EPYC 7452)",
        "seq_length": args.seq_length,
        "backward_split": BACKWARD_SPLIT,
        "fig10_mbs_scaling": {"average_by_mbs": _averages(mbs_rows, "mbs"), "runs": mbs_rows},
        "fig11_gbs_scaling": {"average_by_gbs_factor": _averages(gbs_rows, "gbs_factor"),
                              "runs": gbs_rows},
        "wall_seconds": round(time.perf_counter() - started, 1),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
