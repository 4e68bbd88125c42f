"""Data parallelism against a deeper pipeline on the same processes and global batch.

    .venv/bin/python bench/data_parallel.py --nproc 2 --rounds 3 --json \
        [pretrain_llama.py flags, e.g. --model-preset small --train-iters 4]

Two configurations of `--nproc` processes train the same model on the same global batch:
one pipeline of `nproc` ranks (D = 1), and `nproc` replicas of a one-rank pipeline
(D = nproc, ZeRO-2). Each round runs both as separate torchrun jobs, the order alternating
from round to round; a configuration's figure is the median over rounds of its median
iteration time (iterations 2-N, the first is a warm-up), with min and max over rounds, and
the speed-up of data parallelism is the median of the per-round ratios. Also reported: the
host optimizer state per process and the shared memory per node (from the metrics).

Prints one JSON object (--json) or a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.spread import spread  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def run(nproc: int, flags: list[str], extra: list[str], out: str) -> list[dict]:
    metrics = os.path.join(out, "metrics.jsonl")
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "pretrain_llama.py"), *flags, *extra, "--metrics-file", metrics]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}")
    with open(metrics) as f:
        return [row for row in map(json.loads, f) if "evaluation" not in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    own, flags = parser.parse_known_args()
    configs = {
        "pipeline": ["--pipeline-schedule", "decoupled"],
        "data-parallel": ["--pipeline-schedule", "decoupled",
                          "--data-parallel-size", str(own.nproc), "--zero-stage", "2"],
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    last: dict[str, dict] = {}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(own.rounds):
            order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
            this_round = {}
            for name in order:
                out = os.path.join(tmp, f"{name}-{round_index}")
                os.makedirs(out)
                rows = run(own.nproc, flags, configs[name], out)
                this_round[name] = statistics.median(r["iter_time_s"] for r in rows[1:])
                times[name].append(this_round[name])
                last[name] = rows[-1]
            ratios.append(this_round["pipeline"] / this_round["data-parallel"])
    result = {
        "nproc": own.nproc, "rounds": own.rounds, "flags": flags,
        "configs": {name: {
            "iteration_s": spread(times[name]),
            "loss": last[name]["loss"],
            "host_optimizer_state_bytes": last[name].get("host_optimizer_state_bytes"),
            "shared_memory_bytes_per_node": last[name].get("shared_memory_bytes_per_node"),
            "bubble_ratio": last[name].get("bubble_ratio"),
        } for name in configs},
        "data_parallel_speedup": spread(ratios),
    }
    if own.json:
        print(json.dumps(result, indent=1))
    else:
        for name, row in result["configs"].items():
            t = row["iteration_s"]
            print(f"{name:14s} {t['median']:.3f} s [{t['min']:.3f}-{t['max']:.3f}] "
                  f"optimizer state {row['host_optimizer_state_bytes']} B/process")
        s = result["data_parallel_speedup"]
        print(f"data-parallel speed-up {s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
