#!/usr/bin/env python3
"""--optimizer-gpu-stride auto against stride 0 where the device memory is tight: 2 CPU
processes training the tiny preset (decoupled) with a device memory capacity
(MEGATRON_CPU_DEVICE_MEMORY) that holds stride 0's plan and leaves the subgroups of the
fullest rank about `--subgroup` parameters: the case that made auto lose on an H100.

    python bench/auto_tight.py [--rounds 3] [--train-iters 8] [--subgroup 8192]

The capacity is the memory model's largest per-rank need (what the fit check holds the run
to) plus the slots of `--subgroup` parameters. The optimizer rates are calibrated
once in the bench's process (cached in a scratch --data-cache-dir, which every run reads),
and a warm-up run with auto says what auto chose and for which layout. Three variants then train in every round,
their order rotating (a disturbance of the shared machine spreads over all):

- auto: --optimizer-gpu-stride auto, priced with the measured mechanism (overlap of the
  two sides, the device side's throughput, a fixed cost per subgroup);
- zero: --optimizer-gpu-stride 0;
- split: the split auto took before it priced the mechanism (Eq. 1's throughputs only, from
  the same cached rates, at the squeezed rank's layout; the stride 2 where these rates
  give none), forced with the subgroup size the capacity leaves that rank
  (--optimizer-subgroup-size; both ranks use it).

A run's figures are medians over its iterations after the first: iteration time and
exposed optimizer time. Each variant's figures: median, min and max over the rounds.
Prints one JSON object. OMP_NUM_THREADS=1, one C++ optimizer thread per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine  # noqa: E402
from bench.spread import spread  # noqa: E402
from megatron.config.placement import split_flag  # noqa: E402
from megatron.data.run_data import prepare_data  # noqa: E402
from megatron.offload.device import CPU_DEVICE_MEMORY_ENV, DeviceLayer  # noqa: E402
from megatron.pipeline.optimizer_calibration import calibrated_update_rates  # noqa: E402
from megatron.planning.run_plan import run_start  # noqa: E402
from megatron.schedules.optimizer_stride import UpdateRates, auto_split  # noqa: E402
from megatron.schedules.subgroup_memory import (  # noqa: E402
    subgroup_size_within,
    subgroup_slots_bytes,
)
from megatron.training.arguments import parse_args  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--model-preset", "tiny", "--pipeline-schedule", "decoupled", "--eval-iters", "0",
       "--cpu-optimizer-threads", "1"]
NPROC = 2
CHOICE = re.compile(r"^rank (\d+): optimizer GPU (.*?) \(auto; Eq\. 1: .*?predicted for (\d+) "
                    r"parameters in subgroups of (\d+): (.*?)\)$", re.MULTILINE)


def capacity_for(cache: str, subgroup: int) -> tuple[int, list[int]]:
    """The capacity that holds every rank's plan (stride 0's: auto starts as it) and leaves
    the fullest rank's subgroups `subgroup` parameters; the per-rank plans."""
    run = parse_args([*RUN, "--optimizer-gpu-stride", "auto", "--data-cache-dir", cache])
    vocab = prepare_data(run, log=lambda line: None).vocab_size
    plan = run_start(run.evolve(model={"vocab_size": vocab}), NPROC, NPROC, on_cuda=False).memory
    needs = [plan.gpu_total(r) for r in range(NPROC)]
    room = subgroup * subgroup_slots_bytes(1, 4)  # as the runtime sizes them (fp32 out)
    assert subgroup_size_within(room) == subgroup
    return max(needs) + room, needs


def train(flags: list[str], capacity: int, cache: str, iters: int, metrics: str
          ) -> tuple[list[dict], str]:
    if os.path.exists(metrics):
        os.remove(metrics)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(NPROC), "pretrain_llama.py", *RUN, *flags, "--data-cache-dir", cache,
         "--train-iters", str(iters), "--log-interval", str(iters), "--metrics-file", metrics],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", CPU_DEVICE_MEMORY_ENV: str(capacity)})
    if proc.returncode != 0:
        sys.exit(f"auto_tight.py: error: the run {flags} failed:\n"
                 + (proc.stdout + proc.stderr)[-3000:])
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if '"iter_time_s"' in line]
    return rows, proc.stdout + proc.stderr


def figures(rows: list[dict]) -> dict:
    rows = rows[1:]  # the first iteration: warm-up
    return {"iteration_ms": statistics.median(r["iter_time_s"] * 1e3 for r in rows),
            "exposed_optimizer_ms": statistics.median(r["exposed_optimizer_time_s"] * 1e3
                                                      for r in rows),
            "stride": rows[-1]["optimizer_gpu_stride"]}


def eq1_split(rates: UpdateRates, numel: int, subgroup: int) -> int:
    """What auto took before it priced the mechanism: Eq. 1's throughputs only."""
    legacy = dataclasses.replace(rates, overlap=1.0, subgroup_overhead_s=0.0,
                                 device_subgroup_params_per_s=None)
    return auto_split(legacy, numel, subgroup).split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--subgroup", type=int, default=8192,
                   help="the subgroup size the capacity leaves the fullest rank")
    args = p.parse_args()
    started = time.time()
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-auto-tight-") as scratch:
        cache = os.path.join(scratch, "cache")
        capacity, needs = capacity_for(cache, args.subgroup)
        metrics = os.path.join(scratch, "metrics.jsonl")
        # calibrated once here, in one process: two ranks calibrating at once on a 2-core
        # machine measure each other (B once came out 20x low, Eq. 1 then gave k = 0)
        with DeviceLayer("cpu") as device:
            rates = calibrated_update_rates(device, 1, cache, log=lambda line: None)
        _, log = train(["--optimizer-gpu-stride", "auto"], capacity, cache, 2, metrics)
        chosen = {int(m[0]): {"choice": m[1], "params": int(m[2]), "subgroup": int(m[3]),
                              "predicted": m[4]} for m in CHOICE.findall(log)}
        rates_line = next((line for line in log.splitlines() if "update rates" in line), "")
        fullest = needs.index(max(needs))
        squeezed = chosen[fullest]
        old = {r: eq1_split(rates, c["params"], c["subgroup"]) for r, c in chosen.items()}
        # Eq. 1's split on the squeezed rank (or another's); these rates may give none (a
        # noisy copy rate makes the CPU look as fast as half a copy): then the stride 2
        split = old[fullest] or next((s for s in old.values() if s), 0) or 2
        variants = {"auto": ["--optimizer-gpu-stride", "auto"],
                    "zero": ["--optimizer-gpu-stride", "0"],
                    "split": ["--optimizer-gpu-stride", split_flag(split),
                              "--optimizer-subgroup-size", str(squeezed["subgroup"])]}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        names = list(variants)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                rows, _ = train(variants[name], capacity, cache, args.train_iters, metrics)
                runs[name].append(figures(rows))
    summary = {name: {key: spread([r[key] for r in results])
                      for key in ("iteration_ms", "exposed_optimizer_ms")}
               for name, results in runs.items()}
    print(json.dumps({
        "command": " ".join(["python", "bench/auto_tight.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(load_average_at_start=load_at_start,
                           load_average_at_end=os.getloadavg()),
        "rounds": args.rounds, "train_iters": args.train_iters,
        "seconds": round(time.time() - started, 1),
        "capacity_bytes": capacity, "plan_bytes_per_rank": needs,
        "calibration": rates_line, "auto_chose": chosen,
        "eq1_would_choose": {r: split_flag(s) for r, s in old.items()},
        "variants": {name: " ".join(flags) for name, flags in variants.items()},
        "figures": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
