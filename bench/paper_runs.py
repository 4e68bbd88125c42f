#!/usr/bin/env python3
"""The planner against the paper's measured runs: what `--plan --json` predicts for every
run behind SysX's Figure 9 (4 x V100 32 GB PCIe per node, fp16, activation recomputation,
micro-batch 2, global batch 16 x nodes, sequence 1024 and 2048), beside the iteration
times the authors measured, and whether each run the paper made is planned as fitting.

    .venv/bin/python bench/paper_runs.py                 # the table and the memory check
    .venv/bin/python bench/paper_runs.py --figures       # + the paper's Fig. 10/11 averages
    .venv/bin/python bench/paper_runs.py --fit           # + the calibration of the profile

Every prediction is the planner's own (`megatron.planning.evaluate.evaluate` on the run's
`pretrain_llama.py --plan` flags: what `--plan` prints): the schedule (SysX: decoupled, 2
forward stages per GPU, d = 3; Mobius and Megatron's interleaved 1F1B with offload: 2
stages per GPU), the shapes the authors' scripts ran (which are not the project's presets,
see PAPER_SHAPES), `--fp16`. Measured: `elapsed` is one iteration, `gpu` the GPU
pipeline's part of it (until the last forward/backward ends); the plan's `gpu` is the
simulated compute end. Errors are factors (predicted / measured); the speedup is SysX's
iteration over Mobius's. `--fit` grid-searches the profile's fitted figures on a subset of
the rows and reports the error of the rows it did not see. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine  # noqa: E402
from megatron.config.errors import ConfigError  # noqa: E402
from megatron.planning.evaluate import base_configuration, evaluate  # noqa: E402
from megatron.schedules.hardware import HardwareProfile, get_hardware  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402

GIB = 2**30
NODES = {"10b": 1, "19b": 1, "30b": 2, "40b": 2, "52b": 4, "69b": 4, "88b": 8, "110b": 8}
# (layers, hidden, FFN, heads): the authors' scripts for 10B-40B (KV heads = heads); the
# paper's Table 2 for 52B-110B, whose scripts are not published, with heads = Table 2's
# KV heads as in the four known ones (an assumption: these rows are not measured here)
PAPER_SHAPES = {"10b": (48, 4096, 11008, 2), "19b": (48, 5632, 13312, 4),
                "30b": (96, 5120, 12800, 4), "40b": (96, 5888, 15360, 4),
                "52b": (96, 6656, 17728, 8), "69b": (96, 7680, 20480, 8),
                "88b": (192, 6144, 16384, 16), "110b": (192, 6912, 18432, 16)}
SCHEDULES = {"spipe": "decoupled", "mobius": "mobius", "megatron": "interleaved-1f1b"}
STAGES_PER_GPU, BACKWARD_SPLIT, GPUS_PER_NODE = 2, 3, 4
# Figure 9's runs, measured by the authors: (model, seq) -> system -> (elapsed, gpu) in ms
MEASURED = {
    ("10b", 1024): {"spipe": (8171, 6013), "mobius": (11922, 6676), "megatron": (11540, 6299)},
    ("10b", 2048): {"spipe": (12707, 11235), "mobius": (17326, 12083), "megatron": (17274, 12029)},
    ("19b", 1024): {"spipe": (14478, 10076), "mobius": (21610, 11911), "megatron": (20679, 11005)},
    ("19b", 2048): {"spipe": (21692, 19326), "mobius": (32679, 22995), "megatron": (30893, 21212)},
    ("30b", 1024): {"spipe": (19953, 17904), "mobius": (27862, 19804), "megatron": (26432, 18389)},
    ("30b", 2048): {"spipe": (35666, 33553), "mobius": (43521, 35454), "megatron": (44480, 36421)},
    ("40b", 1024): {"spipe": (27844, 25143), "mobius": (37069, 26504), "megatron": (34031, 23526)},
    ("40b", 2048): {"spipe": (45399, 42686), "mobius": (62747, 52135), "megatron": (56977, 46422)},
}
FIG9_MICRO_BATCH = 2
# The paper's text (sections 5.2-5.3): averages over the eight models of SysX's speedup
# over Mobius; Fig. 10 at global batch 16 x nodes, Fig. 11 at micro-batch 2 and global
# batch 8 x nodes x factor; Fig. 11's 10B CPU-optimizer speedups by global batch
PAPER_FIG9_AVERAGE = {"over_mobius": 1.26, "over_megatron": 1.51}
PAPER_FIG10_TOTAL = {1: 1.13, 2: 1.17, 4: 1.20, 8: 1.26}
PAPER_FIG10_GPU = {1: 1.00, 2: 1.03, 4: 1.07, 8: 1.12}
PAPER_FIG11_TOTAL = {1: 1.32, 2: 1.26, 3: 1.22, 4: 1.19}
PAPER_FIG11_GPU = {1: 1.15, 2: 1.08, 3: 1.04, 4: 1.05}
PAPER_FIG11_10B_CPU = {8: 1.43, 16: 2.49, 24: 3.57, 32: 3.90}
MOBIUS_OOM_MBS8 = frozenset({"19b", "40b", "69b"})  # section 5.3: only SysX trained these
# Neither figure names its sequence; Fig. 10 fixes a global batch it does not give. Taken:
# sequence 1024 (Fig. 11's 10B CPU-optimizer speedup at global batch 16, 2.49, is the
# table's 2.43 at 1024, 3.56 at 2048) and 32 x nodes for Fig. 10 (its MBS-2 point, 1.17 /
# 1.03 / CPU 3.66, is Fig. 11's 32 x nodes point, 1.19 / 1.05 / 3.68; at 16 x nodes it
# would be Fig. 9's 1.26; and the three models Mobius could not train at micro-batch 8
# are the three the memory model finds fullest there)
FIGURES_SEQ = 1024
FIG10_GLOBAL_BATCH_PER_NODE = 32


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    seq: int
    micro_batch: int
    global_batch: int
    system: str  # spipe, mobius, megatron

    @property
    def nodes(self) -> int:
        return NODES[self.model]

    def flags(self, hardware: str = "paper-v100") -> list[str]:
        """The run's `pretrain_llama.py --plan --json` command line."""
        layers, hidden, ffn, heads = PAPER_SHAPES[self.model]
        flags = ["--plan", "--json", "--hardware", hardware, "--fp16",
                 "--num-layers", str(layers), "--hidden-size", str(hidden),
                 "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
                 "--num-query-groups", str(heads), "--vocab-size", "32000",
                 "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
                 "--micro-batch-size", str(self.micro_batch),
                 "--global-batch-size", str(self.global_batch), "--nodes", str(self.nodes),
                 "--pipeline-schedule", SCHEDULES[self.system],
                 "--forward-stages", str(STAGES_PER_GPU * GPUS_PER_NODE * self.nodes)]
        return flags + (["--backward-split", str(BACKWARD_SPLIT)] if self.system == "spipe"
                        else [])


def plan(run: Run, hardware: HardwareProfile, simulate: bool = True) -> dict:
    """What --plan says of `run` on `hardware`: the iteration and its GPU part (seconds),
    whether it fits, the fullest GPU and what it lacks."""
    config = parse_args(run.flags())
    try:
        evaluation = evaluate(config, base_configuration(config), hardware, simulate)
    except ConfigError as exc:  # a shape the schedule cannot run (Megatron's micro-batches)
        return {"unbuildable": str(exc)}
    memory = evaluation.memory
    worst = max(range(len(memory.per_gpu)), key=memory.gpu_total)
    out = {"fits": evaluation.fits, "gpu_gib": round(memory.gpu_total(worst) / GIB, 2),
           "gpu_terms_gib": {t: round(v / GIB, 2) for t, v in memory.per_gpu[worst].items()},
           "short_gib": round(evaluation.missing[0].missing / GIB, 2) if evaluation.missing
           else 0.0}
    if simulate:
        sim = evaluation.simulation
        out.update(elapsed=sim.iteration_time, gpu=sim.compute_end)
    return out


def factor(predicted: float, measured: float) -> float:
    """How far off, either way: max(p/m, m/p) (1 is exact)."""
    return max(predicted / measured, measured / predicted)


def table(hardware: HardwareProfile, keys: list[tuple[str, int]] | None = None) -> list[dict]:
    rows = []
    for model, seq in keys or list(MEASURED):
        row = {"model": model, "nodes": NODES[model], "seq": seq,
               "global_batch": 16 * NODES[model]}
        for system, (elapsed, gpu) in MEASURED[(model, seq)].items():
            p = plan(Run(model, seq, FIG9_MICRO_BATCH, 16 * NODES[model], system), hardware)
            row[system] = {"measured_s": [elapsed / 1e3, gpu / 1e3],
                           "predicted_s": [round(p["elapsed"], 3), round(p["gpu"], 3)],
                           "ratio": [round(p["elapsed"] * 1e3 / elapsed, 3),
                                     round(p["gpu"] * 1e3 / gpu, 3)],
                           "fits": p["fits"], "gpu_gib": p["gpu_gib"]}
        measured = row["mobius"]["measured_s"][0] / row["spipe"]["measured_s"][0]
        predicted = row["mobius"]["predicted_s"][0] / row["spipe"]["predicted_s"][0]
        row["speedup_over_mobius"] = {"measured": round(measured, 3),
                                      "predicted": round(predicted, 3),
                                      "error": round(predicted / measured - 1, 3)}
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Median and max of the time errors (as factors) and of the speedup errors."""
    elapsed = [factor(*s["ratio"][:1], 1.0) for r in rows for s in _systems(r)]
    gpu = [factor(s["ratio"][1], 1.0) for r in rows for s in _systems(r)]
    speedup = [abs(r["speedup_over_mobius"]["error"]) for r in rows]
    over = sum(s["ratio"][0] > 1 for r in rows for s in _systems(r))
    return {"runs": len(elapsed),
            "elapsed_error_factor": {"median": round(statistics.median(elapsed), 3),
                                     "max": round(max(elapsed), 3)},
            "gpu_error_factor": {"median": round(statistics.median(gpu), 3),
                                 "max": round(max(gpu), 3)},
            "predicted_over_measured": over,
            "speedup_error": {"median": round(statistics.median(speedup), 3),
                              "max": round(max(speedup), 3)},
            "all_fit": all(s["fits"] for r in rows for s in _systems(r))}


def _systems(row: dict) -> list[dict]:
    return [row[s] for s in SCHEDULES]


def paper_runs() -> list[Run]:
    """Every run of the paper the memory check plans: Fig. 9 (both sequences, the three
    systems); micro-batch 1-8 at global batch 16 x nodes (SysX at both sequences, Mobius at
    1024) and at Fig. 10's 32 x nodes (both), Mobius except where the paper says it ran out
    of memory; Fig. 11 (global batch 8-32 x nodes at micro-batch 2, sequence 1024: SysX
    and Mobius)."""
    runs = set()
    for model, nodes in NODES.items():
        for seq in (1024, 2048):
            runs |= {Run(model, seq, 2, 16 * nodes, s) for s in SCHEDULES}
            runs |= {Run(model, seq, mbs, 16 * nodes, "spipe") for mbs in (1, 2, 4, 8)}
        runs |= {Run(model, seq, mbs, gbs * nodes, "mobius")
                 for mbs in (1, 2, 4, 8) for seq, gbs in ((1024, 16), (FIGURES_SEQ, 32))
                 if not (mbs == 8 and model in MOBIUS_OOM_MBS8)}
        runs |= {Run(model, FIGURES_SEQ, mbs, FIG10_GLOBAL_BATCH_PER_NODE * nodes, "spipe")
                 for mbs in (1, 2, 4, 8)}
        runs |= {Run(model, 1024, 2, 8 * nodes * k, s) for k in (1, 2, 3, 4)
                 for s in ("spipe", "mobius")}
    return sorted(runs, key=lambda r: (r.nodes, r.model, r.seq, r.micro_batch,
                                       r.global_batch, r.system))


def memory_check(hardware: HardwareProfile) -> dict:
    planned = [(run, plan(run, hardware, simulate=False)) for run in paper_runs()]
    short = [{**dataclasses.asdict(run), "short_gib": p["short_gib"], "gpu_gib": p["gpu_gib"],
              "terms_gib": p["gpu_terms_gib"]}
             for run, p in planned if p.get("fits") is False]
    unbuildable = [{**dataclasses.asdict(run), "why": p["unbuildable"]}
                   for run, p in planned if "unbuildable" in p]
    fullest = max((p["gpu_gib"] for _, p in planned if "gpu_gib" in p), default=0.0)
    return {"runs": len(planned),
            "planned_as_fitting": sum(p.get("fits") is True for _, p in planned),
            "unbuildable": unbuildable,
            "fullest_gpu_gib": fullest,
            "gpu_free_gib": round((hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes)
                                  / GIB, 2),
            "not_fitting": short}


def figures(hardware: HardwareProfile) -> dict:
    """The paper's text's averages (Fig. 9, 10, 11), ours beside them, with every run's
    speedups: SysX over Mobius, total (iteration), GPU pipeline (compute end) and CPU
    optimizer (the iteration's part after the compute end)."""
    def pair(model: str, seq: int, mbs: int, gbs: int) -> dict:
        spipe = plan(Run(model, seq, mbs, gbs, "spipe"), hardware)
        mobius = plan(Run(model, seq, mbs, gbs, "mobius"), hardware)
        return {"model": model, "seq": seq, "micro_batch": mbs, "global_batch": gbs,
                "total": round(mobius["elapsed"] / spipe["elapsed"], 4),
                "gpu": round(mobius["gpu"] / spipe["gpu"], 4),
                "cpu": round((mobius["elapsed"] - mobius["gpu"])
                             / max(spipe["elapsed"] - spipe["gpu"], 1e-9), 4)}

    def beside(ours: dict, paper: dict) -> dict:
        return {str(k): {"ours": round(v, 3), "paper": paper[k],
                         "error": round(v / paper[k] - 1, 3)} for k, v in ours.items()}

    def averages(runs: dict, metric: str, paper: dict) -> dict:
        return beside({k: statistics.mean(p[metric] for p in v) for k, v in runs.items()},
                      paper)

    by_mbs = {mbs: [pair(m, FIGURES_SEQ, mbs, FIG10_GLOBAL_BATCH_PER_NODE * n)
                    for m, n in NODES.items() if not (mbs == 8 and m in MOBIUS_OOM_MBS8)]
              for mbs in (1, 2, 4, 8)}
    by_factor = {k: [pair(m, FIGURES_SEQ, 2, 8 * n * k) for m, n in NODES.items()]
                 for k in (1, 2, 3, 4)}
    fig9 = [pair(m, seq, 2, 16 * n) for m, n in NODES.items() for seq in (1024, 2048)]
    megatron = [plan(Run(p["model"], p["seq"], 2, p["global_batch"], "megatron"),
                     hardware)["elapsed"]
                / plan(Run(p["model"], p["seq"], 2, p["global_batch"], "spipe"),
                       hardware)["elapsed"] for p in fig9]
    return {
        "fig9_average": beside({"over_mobius": statistics.mean(p["total"] for p in fig9),
                                "over_megatron": statistics.mean(megatron)},
                               PAPER_FIG9_AVERAGE),
        "fig10": {"total": averages(by_mbs, "total", PAPER_FIG10_TOTAL),
                  "gpu_pipeline": averages(by_mbs, "gpu", PAPER_FIG10_GPU)},
        "fig11": {"total": averages(by_factor, "total", PAPER_FIG11_TOTAL),
                  "gpu_pipeline": averages(by_factor, "gpu", PAPER_FIG11_GPU),
                  "cpu_optimizer_10b": beside({8 * k: v[0]["cpu"] for k, v in by_factor.items()},
                                              PAPER_FIG11_10B_CPU)},
        "runs": {"fig9": fig9, "fig10": [p for v in by_mbs.values() for p in v],
                 "fig11": [p for v in by_factor.values() for p in v]},
    }


# --fit: the profile's fitted figures, by grid search on a subset of the table's rows
GPU_GRID = {"efficiency_half_tokens": (0, 128, 256), "pass_overhead_s": (0.0, 0.0075, 0.015)}
CPU_GRID = {"cpu_optimizer_params_per_s": (1.9e9, 2.0e9, 2.1e9),
            "single_update_share": (1.0, 0.75)}


def _errors(rows: list[dict]) -> list[float]:
    """Log errors of every elapsed and GPU time and of every speedup."""
    return ([math.log(s["ratio"][i]) for r in rows for s in _systems(r) for i in (0, 1)]
            + [math.log(1 + r["speedup_over_mobius"]["error"]) for r in rows])


def fit(base: HardwareProfile, train: list[tuple[str, int]]) -> dict:
    """The profile's fitted figures on the `train` rows, least RMS log error over their
    elapsed and GPU times and speedups: for each point of GPU_GRID (the efficiency curve's
    half point, the per-pass overhead), the peak efficiency that centres the GPU times
    (their log errors' mean to 0, twice), then each point of CPU_GRID (the node's CPU Adam
    rate, one update's share of its lane)."""
    grid = []
    for half in GPU_GRID["efficiency_half_tokens"]:
        for overhead in GPU_GRID["pass_overhead_s"]:
            hardware = dataclasses.replace(base, efficiency_half_tokens=half,
                                           pass_overhead_s=overhead)
            for _ in range(2):
                rows = table(hardware, train)
                shift = statistics.mean(math.log(s["ratio"][1]) for r in rows
                                        for s in _systems(r))
                hardware = dataclasses.replace(
                    hardware, gpu_max_efficiency=hardware.gpu_max_efficiency * math.exp(shift))
            for rate in CPU_GRID["cpu_optimizer_params_per_s"]:
                for share in CPU_GRID["single_update_share"]:
                    candidate = dataclasses.replace(hardware, cpu_optimizer_params_per_s=rate,
                                                    single_update_share=share)
                    errors = _errors(table(candidate, train))
                    grid.append({"efficiency_half_tokens": half, "pass_overhead_s": overhead,
                                 "gpu_max_efficiency": round(candidate.gpu_max_efficiency, 4),
                                 "cpu_optimizer_params_per_s": rate,
                                 "single_update_share": share,
                                 "rms_log_error": round(math.sqrt(statistics.mean(
                                     e * e for e in errors)), 4)})
                    print(json.dumps(grid[-1]), file=sys.stderr, flush=True)
    best = min(grid, key=lambda g: g["rms_log_error"])
    return {"train": [list(k) for k in train], "grid": grid, "best": best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="paper-v100",
                        help="a built-in profile or a profile JSON file")
    parser.add_argument("--figures", action="store_true",
                        help="also the paper's Fig. 9-11 averages (minutes: 8-node runs)")
    parser.add_argument("--fit", action="store_true",
                        help="also grid-search the fitted figures on the 1-node rows and "
                             "report the 2-node rows' error with the fit (minutes)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the memory check of every run the paper made")
    args = parser.parse_args(argv)
    try:
        hardware = get_hardware(args.hardware)
    except KeyError as exc:
        parser.exit(2, f"paper_runs.py: error: --hardware: {exc.args[0]}\n")
    started = time.perf_counter()
    rows = table(hardware)
    out = {"machine": machine(), "date": datetime.date.today().isoformat(),
           "hardware": hardware.name, "summary": summary(rows), "table": rows}
    if not args.no_memory:
        out["memory"] = memory_check(hardware)
        # Every run the paper made ran on these GPUs: any planned as not fitting is a miss
        out["summary"]["paper_runs_checked"] = out["memory"]["runs"]
        out["summary"]["paper_runs_planned_not_fitting"] = len(out["memory"]["not_fitting"])
        out["summary"]["paper_runs_not_planned"] = len(out["memory"]["unbuildable"])
    if args.figures:
        out["figures"] = figures(hardware)
    if args.fit:
        train = [k for k in MEASURED if NODES[k[0]] == 1]
        result = fit(hardware, train)
        fitted = dataclasses.replace(hardware, **{k: v for k, v in result["best"].items()
                                                  if k != "rms_log_error"})
        held_out = table(fitted, [k for k in MEASURED if k not in train])
        out["fit"] = {**result, "held_out": summary(held_out),
                      "held_out_rows": held_out}
    out["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
