#!/usr/bin/env python3
"""Exposed optimizer time of `make train`'s run (the tiny preset, decoupled, 2 CPU
processes), this tree against a git revision, in interleaved rounds.

    python bench/exposed_optimizer.py --baseline REV [--rounds 3] [--train-iters 10]

Each round trains once with each tree, the order alternating from round to round, with
OMP_NUM_THREADS=1 as `make train` does. A run's figures are medians over its iterations
after the first (a warm-up): the exposed optimizer time, its share of the iteration, the
iteration time, each rank's exposed time and (where the tree reports it) each rank's wait
in the verdict's all-reduce for its peers. Each tree's figures are the medians over the
rounds with min and max. The baseline tree is `git archive REV` with this tree's built
C++ optimizer (refused when csrc/ differs). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine  # noqa: E402
from bench.spread import spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--model-preset", "tiny", "--pipeline-schedule", "decoupled", "--eval-iters", "0"]


def export_tree(rev: str, into: str) -> str:
    """`rev`'s files under `into`, with this tree's built extension modules."""
    if subprocess.run(["git", "diff", "--quiet", rev, "--", "csrc"], cwd=ROOT).returncode:
        sys.exit(f"exposed_optimizer.py: error: --baseline {rev}: csrc/ differs from this "
                 "tree's, expected a revision whose C++ optimizer this tree's build matches")
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    built = os.path.join(ROOT, "megatron", "optimizer")
    for name in os.listdir(built):
        if name.endswith(".so"):
            shutil.copy2(os.path.join(built, name), os.path.join(into, "megatron", "optimizer"))
    return into


def train(tree: str, iters: int, nproc: int, metrics: str) -> list[dict]:
    if os.path.exists(metrics):
        os.remove(metrics)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), "pretrain_llama.py", *RUN, "--train-iters", str(iters),
         "--log-interval", str(iters), "--metrics-file", metrics],
        cwd=tree, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"exposed_optimizer.py: error: the run in {tree} failed:\n"
                 + (proc.stdout + proc.stderr)[-3000:])
    with open(metrics) as f:
        return [json.loads(line) for line in f if '"iter_time_s"' in line]


def figures(rows: list[dict]) -> dict:
    """Medians over the iterations after the first."""
    rows = rows[1:]
    out = {"exposed_optimizer_ms": statistics.median(r["exposed_optimizer_time_s"] * 1e3
                                                     for r in rows),
           "exposed_share": statistics.median(r["exposed_optimizer_time_s"] / r["iter_time_s"]
                                              for r in rows),
           "iteration_ms": statistics.median(r["iter_time_s"] * 1e3 for r in rows)}
    for r in range(len(rows[0]["per_rank"])):
        out[f"rank{r}_exposed_ms"] = statistics.median(
            row["per_rank"][r]["exposed_optimizer_time_s"] * 1e3 for row in rows)
        if "verdict_peer_wait_s" in rows[0]["per_rank"][r]:
            out[f"rank{r}_verdict_peer_wait_ms"] = statistics.median(
                row["per_rank"][r]["verdict_peer_wait_s"] * 1e3 for row in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="bench-exposed-") as scratch:
        baseline = os.path.join(scratch, "baseline")
        os.makedirs(baseline)
        trees = {"baseline": export_tree(rev, baseline), "this tree": ROOT}
        started = time.time()
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                rows = train(trees[name], args.train_iters, args.nproc,
                             os.path.join(scratch, f"{name.replace(' ', '-')}.jsonl"))
                runs[name].append(figures(rows))
    summary = {name: {key: spread([r[key] for r in results]) for key in results[0]}
               for name, results in runs.items()}
    print(json.dumps({
        "command": " ".join(["python", "bench/exposed_optimizer.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(load_average_at_end=os.getloadavg()),
        "baseline": rev, "rounds": args.rounds, "train_iters": args.train_iters,
        "nproc": args.nproc, "seconds": round(time.time() - started, 1),
        "figures": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
