#!/usr/bin/env python3
"""SysX Fig. 10, 11, 12 and 14 in simulation, ours beside the paper's.

For each LLaMA-2 model of SysX Table 2 on its number of nodes (4 V100 per node, the
paper-v100 hardware profile by default), simulates one iteration of Mobius (interleaved
AFAB, coupled, synchronized CPU optimizer) and of the decoupled schedule (d backward stages
per forward stage, per-stage CPU optimizer overlapped with the backward passes), with 2
forward stages per GPU and sequence length 1024, while
- Fig. 10: the micro-batch size (MBS) varies over 1, 2, 4, 8 at a global batch of
  16 x nodes (the MBS-8 average leaves out 19B, 40B and 69B, which Mobius could not train
  there in the paper: SysX 5.3);
- Fig. 11: the global batch (GBS) grows by 1, 2, 3, 4 times 8 x nodes at MBS 2;
- Fig. 12: the share of GPU time (until the last backward ends) in the iteration of 19B
  (1 node) and 69B (4 nodes), averaged over CFG0-CFG4 of SysX Table 3 (GBS 16 x nodes,
  MBS 2);
- Fig. 14: the rollback overhead of 10B (1 node, MBS 2) at GBS 8, 16, 24, 32: one reverse
  Adam pass plus the exposed optimizer step it undoes, over the decoupled iteration.
Speedups: total (iteration time), GPU pipeline (time until the last backward ends) and
CPU optimizer (exposed optimizer time). Prints one JSON object; `max_rel_error_vs_paper`
is over the Fig. 10 and Fig. 11 total-speedup averages.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.presets import get_preset  # noqa: E402
from megatron.schedules import Schedule, build_schedule, derived_costs, simulate  # noqa: E402
from megatron.schedules.cost_model import CostModel, rollback_time  # noqa: E402
from megatron.schedules.generators import (  # noqa: E402
    RECOMPUTE_BACKWARD_RATIO,
    _decoupled_orders,
    schedule_kind,
)
from megatron.schedules.hardware import HardwareProfile, get_hardware  # noqa: E402
from megatron.schedules.lowering import SYNCHRONOUS_OPTIMIZER, build_programs  # noqa: E402
from megatron.schedules.validator import ValidationReport, validate  # noqa: E402

# SysX Table 2: model -> nodes.
PAPER_MODELS = {"10b": 1, "19b": 1, "30b": 2, "40b": 2, "52b": 4, "69b": 4, "88b": 8, "110b": 8}
GPUS_PER_NODE = 4
STAGES_PER_GPU = 2
# Backward + recompute is about 3x the forward: 3 backward stages per forward stage make
# a backward stage about as long as a forward one (SysX 3.1).
BACKWARD_SPLIT = 3

# The paper's figures, from its text (SysX 5.3, 5.4, 5.6).
PAPER_FIG10 = {  # MBS -> average speedup over Mobius
    "speedup_total": {1: 1.13, 2: 1.17, 4: 1.20, 8: 1.26},
    "speedup_gpu_pipeline": {1: 1.00, 2: 1.03, 4: 1.07, 8: 1.12},
    "speedup_cpu_optimizer": {1: 3.68, 2: 3.66, 4: 3.67, 8: 3.61},
}
PAPER_FIG11 = {  # GBS factor -> average speedup over Mobius
    "speedup_total": {1: 1.32, 2: 1.26, 3: 1.22, 4: 1.19},
    "speedup_gpu_pipeline": {1: 1.15, 2: 1.08, 3: 1.04, 4: 1.05},
    "speedup_cpu_optimizer": {1: 2.38, 2: 3.07, 3: 3.22, 4: 3.68},
}
PAPER_FIG12_GPU_SHARE = {"19b": 0.413, "69b": 0.778}
# 53 % at a batch of 8 ("once every 100 iterations for a batch size of 8 ... 0.53 %"), 8 %
# at the largest; the text names no other batch size: we take 10B's Fig. 11 series, 8-32.
PAPER_FIG14_ROLLBACK = {8: 0.53, 32: 0.08}
FIG14_GBS = (8, 16, 24, 32)
# Mobius ran out of GPU memory for these at MBS 8 (SysX 5.3): no Fig. 10 point there.
MOBIUS_OOM_MBS8 = frozenset({"19b", "40b", "69b"})


def paper_schedule(name: str, model: str, nodes: int, micro_batch_size: int,
                   global_batch: int) -> Schedule:
    """Schedule `name` for `model` on `nodes` nodes of the paper's testbed: 2 forward stages
    per GPU, even layers, d = BACKWARD_SPLIT for the decoupled schedule (1 otherwise)."""
    preset = get_preset(model)
    ranks = GPUS_PER_NODE * nodes
    stages = STAGES_PER_GPU * ranks
    partition = [preset.num_layers // stages] * stages
    partition[-1] += preset.num_layers - sum(partition)
    split = BACKWARD_SPLIT if schedule_kind(name).splits_backward else 1
    return build_schedule(name, ranks, stages, split, global_batch // micro_batch_size,
                          partition, backward_ratio=RECOMPUTE_BACKWARD_RATIO)


def synchronous_decoupled(shape: Schedule) -> Schedule:
    """The decoupled assignment and order of `shape` (built with lower=False) with Mobius'
    optimizer: check and all-reduce after every backward, then the steps (CFG0-CFG2)."""
    orders = _decoupled_orders(shape.ranks, shape.forward_stages, shape.micro_batches,
                               shape.backward_rank)
    return Schedule(**{**vars(shape), "programs": build_programs(
        shape, orders, SYNCHRONOUS_OPTIMIZER, RECOMPUTE_BACKWARD_RATIO)})


@functools.cache
def _schedule(name: str, model: str, nodes: int, micro_batch_size: int, global_batch: int,
              split: int | None = None) -> tuple[Schedule, ValidationReport]:
    """A schedule and its validation, built once per shape (the costs change, not these).
    name "decoupled-sync": the decoupled schedule with the synchronous optimizer; `split`
    overrides d for the decoupled ones."""
    if name == "decoupled-sync" or split is not None:
        preset = get_preset(model)
        ranks = GPUS_PER_NODE * nodes
        stages = STAGES_PER_GPU * ranks
        partition = [preset.num_layers // stages] * stages
        partition[-1] += preset.num_layers - sum(partition)
        shape = build_schedule("decoupled", ranks, stages, split or BACKWARD_SPLIT,
                               global_batch // micro_batch_size, partition, lower=False)
        schedule = (synchronous_decoupled(shape) if name == "decoupled-sync" else
                    build_schedule("decoupled", ranks, stages, split or BACKWARD_SPLIT,
                                   global_batch // micro_batch_size, partition,
                                   backward_ratio=RECOMPUTE_BACKWARD_RATIO))
    else:
        schedule = paper_schedule(name, model, nodes, micro_batch_size, global_batch)
    return schedule, validate(schedule)


def _simulate(hardware: HardwareProfile, name: str, model: str, nodes: int,
              micro_batch_size: int, global_batch: int, seq_length: int,
              split: int | None = None, ideal_communication: bool = False):
    schedule, report = _schedule(name, model, nodes, micro_batch_size, global_batch, split)
    costs = derived_costs(schedule, get_preset(model), hardware, micro_batch_size, seq_length)
    if ideal_communication:
        costs = CostModel(**{**vars(costs), "p2p_activation": 0.0, "p2p_checkpoint": 0.0})
    return schedule, costs, simulate(schedule, costs, report=report)


def run_pair(model: str, nodes: int, micro_batch_size: int, global_batch: int,
             seq_length: int, hardware: HardwareProfile | str = "paper-v100") -> dict:
    hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
    ranks = GPUS_PER_NODE * nodes
    results = {name: _simulate(hardware, name, model, nodes, micro_batch_size, global_batch,
                               seq_length)[2]
               for name in ("mobius", "decoupled")}
    mobius, decoupled = results["mobius"], results["decoupled"]
    return {
        "model": model, "nodes": nodes, "ranks": ranks, "forward_stages": STAGES_PER_GPU * ranks,
        "mbs": micro_batch_size, "gbs": global_batch,
        "micro_batches": global_batch // micro_batch_size,
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


def fig12_gpu_share(model: str, hardware: HardwareProfile, seq_length: int = 1024) -> dict:
    """GPU time over iteration time for CFG0-CFG4 (SysX Table 3) and their mean: CFG0 the
    decoupled assignment with d = 1 and the synchronous optimizer; CFG1 and CFG2 (the
    checkpoint transfers, asynchronous here in any case) with d = 3; CFG3 adds the
    post-step CPU optimizer; CFG4 prices activation and checkpoint transfers at 0."""
    nodes = PAPER_MODELS[model]
    gbs, mbs = 16 * nodes, 2
    configs = {
        "cfg0": dict(name="decoupled-sync", split=1),
        "cfg1": dict(name="decoupled-sync"),
        "cfg2": dict(name="decoupled-sync"),
        "cfg3": dict(name="decoupled"),
        "cfg4": dict(name="decoupled", ideal_communication=True),
    }
    shares = {}
    for cfg, options in configs.items():
        result = _simulate(hardware, options["name"], model, nodes, mbs, gbs, seq_length,
                           split=options.get("split"),
                           ideal_communication=options.get("ideal_communication", False))[2]
        shares[cfg] = result.compute_end / result.iteration_time
    shares["mean"] = sum(shares.values()) / len(configs)
    return shares


def fig14_rollback(hardware: HardwareProfile, seq_length: int = 1024) -> dict:
    """10B on 1 node, MBS 2: (rollback + exposed optimizer step) / decoupled iteration."""
    overheads = {}
    for gbs in FIG14_GBS:
        schedule, costs, result = _simulate(hardware, "decoupled", "10b", 1, 2, gbs,
                                            seq_length)
        overheads[gbs] = ((rollback_time(schedule, costs) + result.exposed_optimizer_time)
                          / result.iteration_time)
    return overheads


def _averages(rows: list[dict], key: str) -> dict:
    table = {}
    for value in sorted({row[key] for row in rows}):
        chosen = [row for row in rows if row[key] == value and not row.get("mobius_oom")]
        table[value] = {
            metric: sum(row[metric] for row in chosen) / len(chosen)
            for metric in ("speedup_total", "speedup_gpu_pipeline", "speedup_cpu_optimizer")
        }
    return table


def _relative(ours: float, paper: float) -> float:
    return round((ours - paper) / paper, 3)


def _beside(ours: dict, paper: dict) -> dict:
    """{point: {metric: {"ours", "paper", "rel_error"}}} for every metric the paper gives."""
    return {
        str(point): {metric: {"ours": round(values[metric], 3),
                              "paper": paper[metric][point],
                              "rel_error": _relative(values[metric], paper[metric][point])}
                     for metric in paper}
        for point, values in ours.items()
    }


def sweep(hardware: HardwareProfile, models: list[str], seq_length: int = 1024,
          extras: bool = True) -> dict:
    """All figures on `hardware` (Fig. 12 and 14 only for the models they name, and only
    with `extras`)."""
    mbs_rows, gbs_rows = [], []
    for model in models:
        nodes = PAPER_MODELS[model]
        for mbs in (1, 2, 4, 8):
            row = run_pair(model, nodes, mbs, 16 * nodes, seq_length, hardware)
            row["mobius_oom"] = mbs == 8 and model in MOBIUS_OOM_MBS8
            mbs_rows.append(row)
        for factor in (1, 2, 3, 4):
            row = run_pair(model, nodes, 2, 8 * nodes * factor, seq_length, hardware)
            row["gbs_factor"] = factor
            gbs_rows.append(row)
    fig10 = _beside(_averages(mbs_rows, "mbs"), PAPER_FIG10)
    fig11 = _beside(_averages(gbs_rows, "gbs_factor"), PAPER_FIG11)
    errors = [abs(v["speedup_total"]["rel_error"]) for v in (*fig10.values(), *fig11.values())]
    out = {
        "max_rel_error_vs_paper": max(errors),
        "fig10_mbs_scaling": {"average_by_mbs": fig10, "runs": mbs_rows},
        "fig11_gbs_scaling": {"average_by_gbs_factor": fig11, "runs": gbs_rows},
    }
    if extras:
        out["fig12_gpu_time_share"] = {
            model: {"ours_by_config": {k: round(v, 3) for k, v in shares.items()},
                    "ours": round(shares["mean"], 3), "paper": paper,
                    "rel_error": _relative(shares["mean"], paper)}
            for model, paper in PAPER_FIG12_GPU_SHARE.items() if model in models
            for shares in [fig12_gpu_share(model, hardware, seq_length)]
        }
        if "10b" in models:
            overheads = fig14_rollback(hardware, seq_length)
            out["fig14_rollback_overhead_10b"] = {
                str(gbs): {"ours": round(value, 3),
                           **({"paper": PAPER_FIG14_ROLLBACK[gbs],
                               "rel_error": _relative(value, PAPER_FIG14_ROLLBACK[gbs])}
                              if gbs in PAPER_FIG14_ROLLBACK else {})}
                for gbs, value in overheads.items()
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PAPER_MODELS),
                        help="comma-separated presets from SysX Table 2")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--hardware", default="paper-v100",
                        help="a built-in profile or a profile JSON file")
    args = parser.parse_args(argv)
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PAPER_MODELS]
    if unknown:
        parser.exit(2, f"pipeline_sweep.py: error: --models {','.join(unknown)}: expected "
                       f"some of {','.join(PAPER_MODELS)}\n")
    try:
        hardware = get_hardware(args.hardware)
    except KeyError as exc:
        parser.exit(2, f"pipeline_sweep.py: error: --hardware: {exc.args[0]}\n")
    started = time.perf_counter()
    result = sweep(hardware, models, args.seq_length)
    print(json.dumps({
        "hardware": f"{hardware.name} (simulated): {hardware.description}",
        "seq_length": args.seq_length,
        "backward_split": BACKWARD_SPLIT,
        **result,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
