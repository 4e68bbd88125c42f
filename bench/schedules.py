"""Every schedule on the same model, data and machine, interleaved over rounds, measured
and simulated; and how well the run's own plan predicted each.

    torchrun --standalone --nproc-per-node 2 bench/schedules.py --model-preset tiny \
        --train-iters 6 --json [--schedules decoupled,mobius] [--rounds 3] \
        [--baseline mobius] [--out-dir DIR] [--hardware FILE | --profile-each-round]
        [--compute-each-run]

Each round runs every schedule once, the order rotated from round to round; a schedule's
figures are medians over the rounds, with min and max, and its speed-up over --baseline is
the median of the per-round ratios (the two ran back to back in each round).

Any pretrain_llama.py flag applies to every schedule, except --backward-split, which only
the decoupled schedule uses (the baselines are coupled, d = 1). Each schedule trains from
the same initial weights for --train-iters iterations; the first iteration is a warm-up
and is left out of the means. Beside each measurement: the simulator's prediction for the
same configuration, with a cost model calibrated from the measured run (forward and
backward times per stage, the CPU optimizer's speed, the copy bandwidth).

The plan's own prediction: with --hardware FILE (tools/profile_hardware.py's profile of
this machine), each run prices its plan on it, as --plan does, and records the prediction
beside every measured iteration (megatron/planning/run_plan.py); with
--profile-each-round, rank 0 measures the machine with tools/profile_hardware.py at the
start of every round (for the run's model, one process per rank) and that round's runs
are priced on that round's profile. Reported per schedule: predicted_over_measured, the
median over the rounds of the per-round ratios with min and max, and whether every round
lies within 0.85-1.15; beside it, the machine's own drift over the rounds: a fixed piece
of work (bench/machine.py fixed_work_rate) timed at the start of every round, its spread
(max - min) / median. Predictions cannot be more repeatable than the machine. Two
figures per round tell a miss's causes apart: measured_over_predicted_compute, the
compute the machine delivered during the run over what its profile priced (the machine
drifting since the profile), and at_run_compute_over_measured, the plan's prediction
with each stage's compute taken from the run's own trace, against that traced (last)
iteration (the pricing of everything else: transfers, overheads, the optimizer, the
schedule's bubbles).

With --compute-each-run the compute is measured again right before every run: rank 0
times the fixed work, then both ranks at once a one-layer stage's FORWARD and BACKWARD at
the run's shape (tools/profile_hardware.py's pass_times, a second of them), and the run is
priced on the round's profile (or --hardware's) with its compute's level and backward
ratio taken from those (tools/profile_hardware.py's with_pass_times), the rest of the
profile as measured; after the run both ranks time the layer's passes again and rank 0
the fixed work. Per run, beside the ratio: round_profile_predicted_over_measured (the
round's profile as it was), the machine's drift across the run, what a prediction made
just before it cannot see (run_compute_after_over_before: the layer's FORWARD after the
run over before it; fixed_work_after_over_before_run) and
fixed_work_before_run_over_round_start; per stage, the traced FORWARD and BACKWARD over
their prices (stage_*_measured_over_predicted). Beside every prediction, the same plan
priced at the profile's passes alone (passes_alone_predicted_over_measured: the
profile's executor_compute_over_pass taken as 1), what that measured factor changes.
Over all runs: how many lie within 0.85-1.15, their median, min and max; steady_runs:
the same over the runs whose layer FORWARD held within 10 % across them.

Rank 0 prints one JSON object (--json) or a table. With --out-dir, each schedule's
metrics file, the last measured iteration's trace (trace.json), with --compute-each-run
the profile its last run was priced on (hardware.json) and with --save-final its last
checkpoint go to DIR/<schedule>/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.machine import fixed_work_rate, machine, relative_spread  # noqa: E402
from bench.spread import spread  # noqa: E402
from megatron.common.files import atomic_write, make_parent_dir  # noqa: E402
from megatron.config.errors import ConfigError  # noqa: E402
from megatron.config.run import RunConfig  # noqa: E402
from megatron.data.run_data import prepare_data  # noqa: E402
from megatron.offload.device import get_device  # noqa: E402
from megatron.pipeline.calibration import (  # noqa: E402
    copy_seconds_per_byte,
    optimizer_seconds_per_param,
)
from megatron.planning.shape import with_schedule  # noqa: E402
from megatron.schedules.cost_model import (  # noqa: E402
    CostModel,
    backward_stage_params,
    calibrated_costs,
    derived_costs,
)
from megatron.schedules.generators import SCHEDULE_NAMES  # noqa: E402
from megatron.schedules.hardware import HardwareProfile, get_hardware  # noqa: E402
from megatron.schedules.simulator import simulate  # noqa: E402
from megatron.schedules.timeline import read_chrome_trace  # noqa: E402
from megatron.training.arguments import exit_bad_input, parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.pipeline_step import PipelineTrainStep  # noqa: E402
from megatron.training.training import train  # noqa: E402
from tools.profile_hardware import measured_dtype, pass_times, with_pass_times  # noqa: E402

ORDER = ("decoupled", "mobius", "interleaved-1f1b", "1f1b", "gpipe")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = (0.85, 1.15)  # predicted / measured, every round
STEADY = (0.9, 1.1)  # the layer's FORWARD after a run over before it: the machine held
LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT"}
# what each round's profile measured of the figures the prediction reads most
PROFILED = ("gpu_peak_flops", "efficiency_half_tokens", "backward_over_forward",
            "pass_overhead_s", "head_rate_over_layer", "head_backward_over_forward",
            "p2p_latency_s", "instruction_overhead_s", "executor_compute_over_pass",
            "cpu_optimizer_params_per_s", "pcie_bytes_per_s", "p2p_bytes_per_s")


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
    p.add_argument("--profile-each-round", action="store_true",
                   help="measure this machine (tools/profile_hardware.py) at the start of "
                        "every round and price that round's runs on it (instead of "
                        "--hardware FILE)")
    p.add_argument("--compute-each-run", action="store_true",
                   help="right before each run, both ranks re-measure a one-layer stage's "
                        "FORWARD and BACKWARD at the run's shape (tools/profile_hardware.py's "
                        "pass_times) and the run is priced on the profile with that compute "
                        "(with --hardware or --profile-each-round)")
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
    base = parse_args(rest)
    if bench.profile_each_round and base.planning.hardware is not None:
        exit_bad_input(ConfigError("--hardware", base.planning.hardware,
                                   "one of --hardware and --profile-each-round"))
    if (bench.compute_each_run and not bench.profile_each_round
            and base.planning.hardware is None):
        exit_bad_input(ConfigError("--compute-each-run", "set",
                                   "needs --hardware FILE or --profile-each-round"))
    bench.model_flags = rest
    return bench, base


def schedule_run(base: RunConfig, name: str, bench: argparse.Namespace,
                 trace: str, profile: str | None) -> RunConfig:
    out = os.path.join(bench.out_dir, name) if bench.out_dir else None
    return with_schedule(base, name).evolve(
        # the last iteration's events calibrate the simulation
        logging={"metrics_file": os.path.join(out, "metrics.jsonl") if out else None,
                 "trace": trace},
        checkpointing={"save": os.path.join(out, "ckpt") if out and bench.save_final
                       else None},
        planning={"hardware": profile or base.planning.hardware})


def measure(name: str, base: RunConfig, bench: argparse.Namespace, trace: str,
            opt_s: float, copy_s: float, profile: str | None = None,
            round_profile: str | None = None) -> dict:
    """One training run of `name`: its iteration times (the first, a warm-up, left out),
    breakdown means, device memory, the calibrated simulation of the same run and, priced
    on `profile` (or --hardware's), its plan's prediction; with `round_profile` (the
    profile `profile` brought up to date from), that profile's prediction beside it."""
    run = schedule_run(base, name, bench, trace, profile)
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
    costs = measured_costs(step, trace, opt_s, copy_s) if os.path.exists(trace) else None
    if costs is not None:
        sim = simulate(step.config.schedule, costs, step.config.report)
        row["simulated_iteration_time_s"] = sim.iteration_time
        row["simulated_bubble_ratio"] = sim.mean_bubble_ratio
        row["simulated_exposed_optimizer_time_s"] = sim.exposed_optimizer_time
    if "predicted_iteration_time_s" in measured[-1]:  # the plan's, in every record
        row["predicted_iteration_time_s"] = measured[-1]["predicted_iteration_time_s"]
        for part in ("gpu_time_s", "bubble_time_s", "exposed_optimizer_time_s"):
            row[f"predicted_{part}"] = measured[-1][f"predicted_{part}"]
        row["predicted_over_measured"] = (row["predicted_iteration_time_s"]
                                          / row["iteration_time_s"])
        # the machine's compute during the run against its profile's (drift), and the
        # prediction at the run's own compute (the rest of the pricing)
        row["measured_over_predicted_compute"] = (row["gpu_time_s"]
                                                  / row["predicted_gpu_time_s"])
        if costs is not None:  # against the traced iteration itself (the last)
            row["at_run_compute_over_measured"] = (plan_priced(step, step.plan.hardware, costs)
                                                   / records[-1]["iter_time_s"])
        if costs is not None:  # each stage's traced FORWARD and BACKWARD over its price
            priced = plan_costs(step, step.plan.hardware)
            row["stage_forward_measured_over_predicted"] = [
                m / p for m, p in zip(costs.forward, priced.forward)]
            row["stage_backward_measured_over_predicted"] = [
                (costs.backward[k] + costs.recompute[k])
                / (priced.backward[k] + priced.recompute[k]) for k in sorted(priced.backward)]
        # the same plan priced at the passes alone (the profile's compute not scaled by
        # its executor's): what the executor_compute_over_pass changes, run by run
        row["passes_alone_predicted_over_measured"] = plan_priced(
            step, replace(step.plan.hardware, executor_compute_over_pass=1.0)
        ) / row["iteration_time_s"]
        if round_profile is not None:  # the compute as the round's profile measured it
            row["round_profile_predicted_over_measured"] = (
                plan_priced(step, get_hardware(round_profile)) / row["iteration_time_s"])
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


def measured_costs(step: PipelineTrainStep, trace_path: str, optimizer_s_per_param: float,
                   copy_s_per_byte: float) -> CostModel:
    """A cost model calibrated from the iteration `step`'s run traced (`--trace`) and the
    measured optimizer and copy rates."""
    params = step_backward_stage_params(step)
    itemsize = step.run.precision.working_bytes
    return calibrated_costs(step.config.schedule, read_chrome_trace(trace_path), params,
                            itemsize, optimizer_s_per_param, copy_s_per_byte)


def plan_costs(step: PipelineTrainStep, hardware: HardwareProfile) -> CostModel:
    """The cost model the run's plan is priced with on `hardware`."""
    plan, run = step.plan, step.run
    model = replace(run.model, vocab_size=step.model_cfg.vocab_size)
    return derived_costs(plan.schedule, model, hardware, run.training.micro_batch_size,
                         model.seq_length, plan.optimizer_bytes_per_param,
                         run.precision.host_gradient_bytes)


def plan_priced(step: PipelineTrainStep, hardware: HardwareProfile,
                measured: CostModel | None = None) -> float:
    """The run's plan priced on `hardware`, as the run priced it on its own profile; with
    `measured`, its compute (each stage's FORWARD and BACKWARD) taken from the run's own
    traced iteration instead: what the plan's pricing of everything else (transfers,
    per-instruction overheads, the optimizer, the schedule's bubbles) gives at the compute
    the machine delivered during the run. Beside the plan's own prediction that separates
    the machine's drift since the profile from the rest of the pricing."""
    plan, costs = step.plan, plan_costs(step, hardware)
    if measured is not None:
        costs = replace(costs, forward=measured.forward, backward=measured.backward,
                        recompute=measured.recompute)
    return simulate(plan.schedule, costs, plan.report).iteration_time


def layer_passes(base: RunConfig) -> tuple[float, float]:
    """Both ranks at once: a one-layer stage's FORWARD and BACKWARD at the run's shape
    (tools/profile_hardware.py's pass_times, as its profile measures them: every process
    playing one GPU at once, about a second of them); the means over the ranks, on every
    rank."""
    device = get_device()
    try:
        dtype = measured_dtype(base, device.kind == "cuda")
        forward_s, backward_s = pass_times(device, base.model, dtype,
                                           base.training.micro_batch_size, budget_s=1.0,
                                           ready=dist.barrier)["layer"]
    finally:
        device.close()
    passes = [None] * dist.get_world_size()
    dist.all_gather_object(passes, (forward_s, backward_s))
    return statistics.mean(f for f, _ in passes), statistics.mean(b for _, b in passes)


def compute_now(base: RunConfig, round_profile: str, out: str) -> dict:
    """Right before a run: rank 0 times the fixed work (the machine's speed now, beside
    the round's start), then both ranks the layer's passes (layer_passes); rank 0 writes
    `round_profile` with that compute (with_pass_times) to `out`. Returns the figures
    measured, on every rank."""
    rate = fixed_work_rate(seconds=0.5) if dist.get_rank() == 0 else 0.0
    forward_s, backward_s = layer_passes(base)
    if dist.get_rank() == 0:
        hardware = with_pass_times(get_hardware(round_profile), base.model,
                                   base.training.micro_batch_size, forward_s, backward_s)
        make_parent_dir(out)
        atomic_write(out, lambda stream: stream.write(hardware.to_json().encode()))
    dist.barrier()
    return {"fixed_work_per_s": rate, "forward_s": forward_s, "backward_s": backward_s}


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
    if "predicted_over_measured" in out:  # per round: each against its own prediction
        ratios = [r["predicted_over_measured"] for r in rows]
        out["predicted_over_measured_spread"] = spread(ratios)
        out["predicted_over_measured_per_round"] = ratios
        out["within_target"] = all(TARGET[0] <= r <= TARGET[1] for r in ratios)
        for key in ("measured_over_predicted_compute", "at_run_compute_over_measured",
                    "passes_alone_predicted_over_measured",
                    "round_profile_predicted_over_measured", "fixed_work_after_over_before_run",
                    "fixed_work_before_run_over_round_start",
                    "run_compute_forward_s", "run_compute_backward_s",
                    "run_compute_after_over_before",
                    "stage_forward_measured_over_predicted",
                    "stage_backward_measured_over_predicted"):
            if key in rows[0]:
                out[f"{key}_per_round"] = [r[key] for r in rows]
    return out


def run_vocabulary(base: RunConfig) -> int:
    """The vocabulary the runs train with (--vocab-size or the tokenizer's, padded), as
    training resolves it from the data."""
    with contextlib.redirect_stdout(sys.stderr):
        return prepare_data(base, log=lambda _: None).vocab_size


def profile_machine(bench: argparse.Namespace, out: str, vocab_size: int) -> str | None:
    """Rank 0 measures this machine into `out` (tools/profile_hardware.py for the run's
    model at its vocabulary `vocab_size`, the head's shape, one process per rank of this
    job) while the other ranks wait; every rank returns the path."""
    if dist.get_rank() == 0:
        # a job of its own: without this job's launcher variables (its store, its ranks)
        env = {k: v for k, v in os.environ.items()
               if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "profile_hardware.py"), "--out", out,
             "--gpus-per-node", str(dist.get_world_size()), *bench.model_flags,
             "--vocab-size", str(vocab_size)],
            capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"bench/schedules.py: tools/profile_hardware.py failed "
                             f"({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    dist.barrier()
    return out


def run(bench: argparse.Namespace, base: RunConfig) -> dict:
    """Rounds of every schedule, the order rotated each round so that no schedule always
    runs first (on a noisy machine, position in the job changes the timing)."""
    bench.dist_info = initialize_distributed()
    rows: dict[str, list[dict]] = {name: [] for name in bench.names}
    # one directory for both ranks (rank 0's name), for the traces and the profiles
    shared = [tempfile.mkdtemp(prefix="bench-schedules-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    scratch = shared[0]
    drift, profiles, load = [], [], []
    # every rank, as training prepares its data (the dataset builder meets in barriers)
    vocab = run_vocabulary(base) if bench.profile_each_round else 0
    try:
        threads = base.cpu_optimizer.cpu_optimizer_threads or 1
        opt_s, copy_s = optimizer_seconds_per_param(threads), copy_seconds_per_byte()
        for round_index in range(bench.rounds):
            if dist.get_rank() == 0:  # the machine's speed now, the others waiting
                load.append(os.getloadavg()[0])
                drift.append(fixed_work_rate())
            dist.barrier()
            profile = None
            if bench.profile_each_round:
                profile = profile_machine(
                    bench, os.path.join(scratch, f"profile-{round_index}.json"), vocab)
                with open(profile) as f:
                    profiles.append(json.load(f))
            round_profile = profile or base.planning.hardware
            shift = round_index % len(bench.names)
            for name in bench.names[shift:] + bench.names[:shift]:
                trace = (os.path.join(bench.out_dir, name, "trace.json") if bench.out_dir
                         else os.path.join(scratch, f"{name}.json"))
                if not bench.compute_each_run:
                    rows[name].append(measure(name, base, bench, trace, opt_s, copy_s,
                                              profile))
                    continue
                # the profile this run is priced on (under --out-dir: the last round's)
                run_profile = (os.path.join(bench.out_dir, name, "hardware.json")
                               if bench.out_dir
                               else os.path.join(scratch, f"profile-{round_index}-{name}.json"))
                before = compute_now(base, round_profile, run_profile)
                row = measure(name, base, bench, trace, opt_s, copy_s, run_profile,
                              round_profile)
                # the machine's drift beside this run: the same passes and fixed work after
                forward_after, _ = layer_passes(base)
                if dist.get_rank() == 0:
                    after = fixed_work_rate(seconds=0.5)
                    row["run_compute_after_over_before"] = forward_after / before["forward_s"]
                    row["run_compute_forward_s"] = before["forward_s"]
                    row["run_compute_backward_s"] = before["backward_s"]
                    row["fixed_work_per_s_before_run"] = before["fixed_work_per_s"]
                    row["fixed_work_after_over_before_run"] = after / before["fixed_work_per_s"]
                    row["fixed_work_before_run_over_round_start"] = (
                        before["fixed_work_per_s"] / drift[-1])
                dist.barrier()
                rows[name].append(row)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        shutdown_distributed()
    baseline = rows.get(bench.baseline)
    return {
        "ranks": bench.dist_info.world_size,
        "model": base.model.name,
        "iterations": base.training.train_iters,
        "rounds": bench.rounds,
        "baseline": bench.baseline if baseline else None,
        "optimizer_s_per_param": opt_s,
        "hardware": "measured each round" if bench.profile_each_round
        else base.planning.hardware,
        "target": list(TARGET),
        "machine": machine(load_average_per_round=load),
        # the machine's own drift over the rounds: what no prediction can be closer than
        "fixed_work_per_s": {"values": drift,
                             "spread": relative_spread(drift) if drift else None},
        "profiles": [{k: p[k] for k in PROFILED} for p in profiles],
        "schedules": [summarize(name, rows[name], baseline) for name in bench.names],
        "predicted_over_measured_all_runs": over_runs(rows, "predicted_over_measured"),
        "round_profile_predicted_over_measured_all_runs": over_runs(
            rows, "round_profile_predicted_over_measured"),
        "passes_alone_predicted_over_measured_all_runs": over_runs(
            rows, "passes_alone_predicted_over_measured"),
        # the machine's drift across each run: the fixed work after it over before it
        "fixed_work_after_over_before_run_all_runs": over_runs(
            rows, "fixed_work_after_over_before_run"),
        "run_compute_after_over_before_all_runs": over_runs(
            rows, "run_compute_after_over_before"),
        # the runs whose layer passes held within 10 % from before the run to after it:
        # where the machine held still, what the prediction itself is worth
        "steady_runs": over_runs(rows, "predicted_over_measured", steady=STEADY),
    }


def over_runs(rows: dict[str, list[dict]], key: str,
              steady: tuple[float, float] | None = None) -> dict | None:
    """`key` over every run of every schedule (with `steady`, those whose
    run_compute_after_over_before lies in it): how many lie within the target, their
    median, min and max (None where no run has it)."""
    values = [r[key] for runs in rows.values() for r in runs if key in r and (
        steady is None or steady[0] <= r.get("run_compute_after_over_before", 0) <= steady[1])]
    if not values:
        return None
    return {"runs": len(values),
            "within_target": sum(TARGET[0] <= v <= TARGET[1] for v in values),
            "median": statistics.median(values), "min": min(values), "max": max(values)}


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
              f"{'bubble':>7} {'sim bubble':>10} {'exposed opt (s)':>15} {'plan (s)':>9} "
              f"{'plan/measured, min-max':>23}")
        for r in summary["schedules"]:
            lo, hi = r["iteration_time_s_spread"]["min"], r["iteration_time_s_spread"]["max"]
            ratio = r.get("predicted_over_measured_spread")
            print(f"{r['schedule']:>18} {r['iteration_time_s']:9.3f} {lo:6.2f}-{hi:<6.2f} "
                  f"{r.get('simulated_iteration_time_s', float('nan')):9.3f} "
                  f"{r['gpu_time_s']:8.3f} {r['bubble_ratio']:7.1%} "
                  f"{r.get('simulated_bubble_ratio', float('nan')):10.1%} "
                  f"{r['exposed_optimizer_time_s']:15.4f} "
                  f"{r.get('predicted_iteration_time_s', float('nan')):9.3f} "
                  + (f"{ratio['median']:9.2f} {ratio['min']:.2f}-{ratio['max']:.2f}"
                     if ratio else ""))
        drift = summary["fixed_work_per_s"]["spread"]
        if drift is not None:
            print(f"the machine's drift over the rounds (a fixed piece of work): {drift:.1%}")
        for key, what in (("predicted_over_measured_all_runs", "predicted/measured"),
                          ("round_profile_predicted_over_measured_all_runs",
                           "on the round's profile"),
                          ("passes_alone_predicted_over_measured_all_runs",
                           "priced at the passes alone"),
                          ("fixed_work_after_over_before_run_all_runs",
                           "fixed work after/before each run"),
                          ("run_compute_after_over_before_all_runs",
                           "the layer's FORWARD after/before each run"),
                          ("steady_runs", "predicted/measured where that held within "
                           f"{STEADY[0]}-{STEADY[1]}")):
            over = summary[key]
            if over is not None:
                print(f"{what}: {over['within_target']} of {over['runs']} runs within "
                      f"{TARGET[0]}-{TARGET[1]}, median {over['median']:.2f}, "
                      f"{over['min']:.2f}-{over['max']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
