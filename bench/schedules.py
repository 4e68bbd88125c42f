"""Every schedule on the same model, data and machine, interleaved over rounds, measured
and simulated.

    torchrun --standalone --nproc-per-node 2 bench/schedules.py --model-preset tiny \
        --train-iters 6 --json [--schedules decoupled,mobius] [--rounds 3] \
        [--baseline mobius] [--out-dir DIR]

Each round runs every schedule once, the order rotated from round to round; a schedule's
figures are medians over the rounds, with min and max, and its speed-up over --baseline is
the median of the per-round ratios (the two ran back to back in each round).

Any pretrain_llama.py flag applies to every schedule, except --backward-split, which only
the decoupled schedule uses (the baselines are coupled, d = 1). Each schedule trains from
the same initial weights for --train-iters iterations; the first iteration is a warm-up
and is left out of the means. Beside each measurement: the simulator's prediction for the
same configuration, with a cost model calibrated from the measured run (forward and
backward times per stage, the CPU optimizer's speed, the copy bandwidth).

Rank 0 prints one JSON object (--json) or a table. With --out-dir, each schedule's
metrics file, the last measured iteration's trace (trace.json) and with --save-final its
last checkpoint go to DIR/<schedule>/. With --hardware FILE (tools/profile_hardware.py's
profile of this machine) each schedule also gets the prediction priced from the profile
alone, as --plan prices it, and its ratio to the measured median (predicted_over_measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.spread import spread  # noqa: E402
from megatron.config.errors import ConfigError  # noqa: E402
from megatron.config.run import RunConfig  # noqa: E402
from megatron.pipeline.calibration import (  # noqa: E402
    copy_seconds_per_byte,
    optimizer_seconds_per_param,
)
from megatron.planning.shape import with_schedule  # noqa: E402
from megatron.schedules.cost_model import (  # noqa: E402
    backward_stage_params,
    calibrated_costs,
    derived_costs,
)
from megatron.schedules.generators import SCHEDULE_NAMES  # noqa: E402
from megatron.schedules.hardware import HardwareProfile, get_hardware  # noqa: E402
from megatron.schedules.simulator import SimResult, simulate  # noqa: E402
from megatron.schedules.timeline import read_chrome_trace  # noqa: E402
from megatron.training.arguments import exit_bad_input, parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.pipeline_step import PipelineTrainStep  # noqa: E402
from megatron.training.training import train  # noqa: E402

ORDER = ("decoupled", "mobius", "interleaved-1f1b", "1f1b", "gpipe")


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--schedules", default=",".join(ORDER),
                   help=f"comma-separated, from {', '.join(ORDER)}")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--save-final", action="store_true",
                   help="save each schedule's final checkpoint under --out-dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every schedule, interleaved (order rotated each round)")
    p.add_argument("--hardware", default=None, metavar="FILE.json",
                   help="a profile from tools/profile_hardware.py on this machine: each "
                        "schedule's iteration is also predicted from it alone, beside the "
                        "measurement (predicted_over_measured)")
    p.add_argument("--baseline", default="mobius",
                   help="the schedule each one's speed-up is measured against, per round")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, RunConfig]:
    bench, rest = bench_parser().parse_known_args(argv)
    names = [n for n in bench.schedules.split(",") if n]
    unknown = [n for n in names if n not in SCHEDULE_NAMES]
    if unknown or not names:
        exit_bad_input(ConfigError("--schedules", bench.schedules,
                                   f"expected names from {', '.join(ORDER)}"))
    if bench.rounds < 1:
        exit_bad_input(ConfigError("--rounds", bench.rounds, "expected at least 1"))
    if bench.baseline not in SCHEDULE_NAMES:
        exit_bad_input(ConfigError("--baseline", bench.baseline,
                                   f"expected a name from {', '.join(ORDER)}"))
    if bench.save_final and not bench.out_dir:
        exit_bad_input(ConfigError("--save-final", "set", "needs --out-dir"))
    bench.names = names
    try:
        bench.profile = get_hardware(bench.hardware) if bench.hardware else None
    except KeyError as exc:
        exit_bad_input(ConfigError("--hardware", bench.hardware, str(exc).strip("'\"")))
    return bench, parse_args(rest)


def schedule_run(base: RunConfig, name: str, bench: argparse.Namespace,
                 trace: str) -> RunConfig:
    out = os.path.join(bench.out_dir, name) if bench.out_dir else None
    return with_schedule(base, name).evolve(
        # the last iteration's events calibrate the simulation
        logging={"metrics_file": os.path.join(out, "metrics.jsonl") if out else None,
                 "trace": trace},
        checkpointing={"save": os.path.join(out, "ckpt") if out and bench.save_final
                       else None})


def measure(name: str, base: RunConfig, bench: argparse.Namespace, trace: str,
            opt_s: float, copy_s: float) -> dict:
    """One training run of `name`: its iteration times (the first, a warm-up, left out),
    breakdown means, device memory and the calibrated simulation of the same run."""
    run = schedule_run(base, name, bench, trace)
    built: list = []
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the result
        records = train(run, dist_info=bench.dist_info, on_step=built.append)
    step = built[0]
    measured = records[1:] or records
    row = {
        "forward_stages": step.config.forward_stages,
        "backward_split": step.config.backward_split,
        "micro_batches": step.config.micro_batches,
        "iteration_time_s": statistics.median(r["iter_time_s"] for r in measured),
        "gpu_time_s": statistics.mean(r["gpu_time_s"] for r in measured),
        "bubble_time_s": statistics.mean(r["bubble_time_s"] for r in measured),
        "exposed_optimizer_time_s": statistics.mean(
            r["exposed_optimizer_time_s"] for r in measured),
        "bubble_ratio": statistics.mean(r["bubble_ratio"] for r in measured),
        "device_memory_peak_bytes": max(r["device_memory_peak_bytes"] for r in measured),
        "device_memory_peak_per_rank": [
            {"rank": r["rank"], "peak_bytes": r["device_memory_peak_bytes"],
             "at_peak": r["device_memory_at_peak"]} for r in records[-1]["per_rank"]],
        "largest_backward_stage_bytes": largest_backward_stage_bytes(step),
        "final_loss": records[-1]["loss"],
    }
    dist.barrier()  # rank 0 has written the trace
    if os.path.exists(trace):
        sim = simulate_measured(step, trace, opt_s, copy_s)
        row["simulated_iteration_time_s"] = sim.iteration_time
        row["simulated_bubble_ratio"] = sim.mean_bubble_ratio
        row["simulated_exposed_optimizer_time_s"] = sim.exposed_optimizer_time
    if bench.profile is not None:
        row["predicted_iteration_time_s"] = simulate_from_profile(
            step, bench.profile).iteration_time
    dist.barrier()
    return row


def largest_backward_stage_bytes(step) -> int:
    """Bytes of the largest backward stage's parameters in the training dtype."""
    itemsize = torch.empty((), dtype=step.config.dtype).element_size()
    return max(step_backward_stage_params(step).values()) * itemsize


def step_backward_stage_params(step: PipelineTrainStep) -> dict:
    """Parameters per backward stage of `step`'s model and schedule."""
    schedule = step.config.schedule
    model = replace(step.run.model, vocab_size=step.model_cfg.vocab_size)
    return backward_stage_params(model, schedule.partition, schedule.backward_split)


def simulate_measured(step: PipelineTrainStep, trace_path: str, optimizer_s_per_param: float,
                      copy_s_per_byte: float) -> SimResult:
    """The simulator's prediction for `step`'s run, with a cost model calibrated from the
    iteration it traced (`--trace`) and the measured optimizer and copy rates."""
    schedule = step.config.schedule
    params = step_backward_stage_params(step)
    itemsize = step.run.precision.working_bytes
    costs = calibrated_costs(schedule, read_chrome_trace(trace_path), params, itemsize,
                             optimizer_s_per_param, copy_s_per_byte)
    return simulate(schedule, costs)


def simulate_from_profile(step: PipelineTrainStep, hardware: HardwareProfile) -> SimResult:
    """The simulator's prediction for `step`'s run priced from a hardware profile alone, as
    the planner prices a candidate (derived_costs of the run's model, schedule and
    micro-batch size, then simulate): nothing of the run's own timings is used."""
    schedule = step.config.schedule
    run = step.run
    model = replace(run.model, vocab_size=step.model_cfg.vocab_size)
    costs = derived_costs(schedule, model, hardware, run.training.micro_batch_size,
                          model.seq_length, run.precision.optimizer_bytes_per_param)
    return simulate(schedule, costs, step.config.report)


def summarize(name: str, rows: list[dict], baseline_rows: list[dict] | None) -> dict:
    """Median over rounds (and min/max) of each measure; the ratio to the baseline is taken
    per round (the two ran back to back) and its median reported."""
    out = {"schedule": name, **{k: rows[0][k] for k in
                                ("forward_stages", "backward_split", "micro_batches",
                                 "device_memory_peak_per_rank")}}
    for key in rows[0]:
        if key not in out and isinstance(rows[0][key], (int, float)):
            out[key] = statistics.median(r[key] for r in rows)
    out["iteration_time_s_spread"] = spread([r["iteration_time_s"] for r in rows])
    if baseline_rows:
        ratios = [b["iteration_time_s"] / r["iteration_time_s"]
                  for r, b in zip(rows, baseline_rows)]
        out["speedup_over_baseline"] = spread(ratios)
    if "predicted_iteration_time_s" in out:
        out["predicted_over_measured"] = (out["predicted_iteration_time_s"]
                                          / out["iteration_time_s"])
    return out


def run(bench: argparse.Namespace, base: RunConfig) -> dict:
    """Rounds of every schedule, the order rotated each round so that no schedule always
    runs first (on a noisy machine, position in the job changes the timing)."""
    bench.dist_info = initialize_distributed()
    rows: dict[str, list[dict]] = {name: [] for name in bench.names}
    traces = tempfile.mkdtemp(prefix="bench-schedules-")  # rank 0 writes each one
    try:
        threads = base.cpu_optimizer.cpu_optimizer_threads or 1
        opt_s, copy_s = optimizer_seconds_per_param(threads), copy_seconds_per_byte()
        for round_index in range(bench.rounds):
            shift = round_index % len(bench.names)
            for name in bench.names[shift:] + bench.names[:shift]:
                trace = (os.path.join(bench.out_dir, name, "trace.json") if bench.out_dir
                         else os.path.join(traces, f"{name}.json"))
                rows[name].append(measure(name, base, bench, trace, opt_s, copy_s))
    finally:
        shutil.rmtree(traces, ignore_errors=True)
        shutdown_distributed()
    baseline = rows.get(bench.baseline)
    return {
        "ranks": bench.dist_info.world_size,
        "model": base.model.name,
        "iterations": base.training.train_iters,
        "rounds": bench.rounds,
        "baseline": bench.baseline if baseline else None,
        "optimizer_s_per_param": opt_s,
        "hardware": bench.hardware,
        "schedules": [summarize(name, rows[name], baseline) for name in bench.names],
    }


def main(argv: list[str] | None = None) -> int:
    bench, base = parse(sys.argv[1:] if argv is None else argv)
    base = base.evolve(logging={"log_interval": max(base.logging.log_interval,  # quiet
                                                    base.training.train_iters)})
    try:
        summary = run(bench, base)
    except ConfigError as exc:
        exit_bad_input(exc)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if bench.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{'schedule':>18} {'iter (s)':>9} {'min-max':>13} {'sim (s)':>9} {'gpu (s)':>8} "
              f"{'bubble':>7} {'sim bubble':>10} {'exposed opt (s)':>15} {'profile (s)':>11}")
        for r in summary["schedules"]:
            lo, hi = r["iteration_time_s_spread"]["min"], r["iteration_time_s_spread"]["max"]
            print(f"{r['schedule']:>18} {r['iteration_time_s']:9.3f} {lo:6.2f}-{hi:<6.2f} "
                  f"{r.get('simulated_iteration_time_s', float('nan')):9.3f} "
                  f"{r['gpu_time_s']:8.3f} {r['bubble_ratio']:7.1%} "
                  f"{r.get('simulated_bubble_ratio', float('nan')):10.1%} "
                  f"{r['exposed_optimizer_time_s']:15.4f} "
                  f"{r.get('predicted_iteration_time_s', float('nan')):11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
