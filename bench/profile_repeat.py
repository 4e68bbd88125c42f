#!/usr/bin/env python3
"""How repeatable a hardware profile is: tools/profile_hardware.py run several times back to
back on one machine, each profile's `--plan` prediction for the run it was measured for,
and how far apart the profiles and their predictions are.

    python bench/profile_repeat.py [--profiles N] [--gpus-per-node G] [--json] MODEL FLAGS

MODEL FLAGS are pretrain_llama.py's, as tools/profile_hardware.py and --plan take them
(default: the tiny preset at 2 processes, the decoupled schedule). A plan is only as good
as the profile it prices: two profiles of the same quiet machine should predict the same
iteration. Reported per profiled quantity that --plan prices: each profile's value, the
median and the spread (max - min) / median; and the same for the predicted iteration time,
which is what a user reads. Run it on a quiet machine: what another job takes from the
cores during one profile and not the other shows up as spread. The floor beside it: the
same fixed work (a 512 x 512 fp32 matmul on one thread, the median of 2 s of them) timed
before each profile; its spread is the machine's own drift over the run, which no profile
can measure away.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.machine import fixed_work_rate, relative_spread  # noqa: E402

# The profile's fields that --plan's cost model reads (megatron/schedules/hardware.py)
PRICED_FIELDS = (
    "gpu_peak_flops", "efficiency_half_tokens", "pass_overhead_s", "backward_over_forward",
    "head_rate_over_layer", "head_backward_over_forward", "p2p_latency_s", "instruction_overhead_s",
    "executor_compute_over_pass", "cpu_optimizer_params_per_s",
    "pcie_bytes_per_s", "d2h_bytes_per_s", "h2d_shm_bytes_per_s", "p2p_bytes_per_s",
    "host_memory_bytes_per_s", "gpu_update_params_per_s", "downscale_params_per_s",
    "device_subgroup_params_per_s", "subgroup_overhead_s", "update_overlap",
)
DEFAULT_MODEL = ["--model-preset", "tiny"]


def run_profile(out: str, gpus: int, rounds: int, model_flags: list[str]) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "profile_hardware.py"), "--out", out,
           "--gpus-per-node", str(gpus), "--rounds", str(rounds), *model_flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"profile_hardware.py failed ({done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1:]}")


def predicted_iteration_s(profile: str, gpus: int, model_flags: list[str]) -> float:
    """`pretrain_llama.py --plan --json` priced with `profile` for the profiled run."""
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_llama.py"), "--plan", "--json",
           "--hardware", profile, "--pipeline-model-parallel-size", str(gpus), *model_flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 3):  # 3: the plan does not fit; still priced
        raise SystemExit(f"--plan failed ({done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)["configuration"]["predicted_iteration_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=int, default=3, help="profiles to take (default 3)")
    parser.add_argument("--gpus-per-node", type=int, default=2,
                        help="processes the profiled run has (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="each profile's rounds of the layer measurement (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args, model_flags = parser.parse_known_args(argv)
    if args.profiles < 2:
        parser.exit(2, f"{parser.prog}: error: --profiles {args.profiles}: expected at "
                       "least 2\n")
    model_flags = model_flags or DEFAULT_MODEL
    profiles, predictions, load, drift = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="profile-repeat-") as tmp:
        for i in range(args.profiles):
            out = os.path.join(tmp, f"profile-{i}.json")
            load.append(os.getloadavg()[0])
            drift.append(fixed_work_rate())
            started = time.perf_counter()
            run_profile(out, args.gpus_per_node, args.rounds, model_flags)
            with open(out) as f:
                profiles.append(json.load(f))
            predictions.append(predicted_iteration_s(out, args.gpus_per_node, model_flags))
            if not args.json:
                print(f"profile {i + 1}/{args.profiles}: {time.perf_counter() - started:.0f} s, "
                      f"predicted iteration {predictions[-1] * 1e3:.2f} ms", file=sys.stderr)
    fields = {name: {"values": [p[name] for p in profiles],
                     "median": statistics.median(p[name] for p in profiles),
                     "spread": relative_spread([p[name] for p in profiles])}
              for name in PRICED_FIELDS if all(p.get(name) is not None for p in profiles)}
    summary = {
        "model_flags": model_flags, "gpus_per_node": args.gpus_per_node,
        "profiles": args.profiles, "rounds_per_profile": args.rounds,
        "machine": profiles[0]["description"], "load_average_at_start": load,
        "compute_spread_within_profiles": [p.get("compute_spread") for p in profiles],
        "fixed_work_per_s": {"values": drift, "median": statistics.median(drift),
                             "spread": relative_spread(drift)},
        "predicted_iteration_s": {"values": predictions,
                                  "median": statistics.median(predictions),
                                  "spread": relative_spread(predictions)},
        "fields": fields,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
