"""What the stream sanitizer costs a training iteration: off (its hooks in place) and on,
against the commit before it, side by side on this machine.

    .venv/bin/python bench/sanitizer.py --before 080c68e --after f1bc567 --rounds 3 [--json]

Each side trains the tiny preset's decoupled pipeline on 2 CPU processes (torchrun) for
--iters iterations: `before` at the commit before the sanitizer, `off` and `on` at the
commit that brought it (`on`: MEGATRON_DEVICE_SANITIZER=1). Both commits are checked out
in temporary worktrees sharing this checkout's .venv and built extension. A side's figure
is the median iteration time of its run, the first two iterations (warm-up) left out; the
sides rotate which goes first each round. Prints the median and range over rounds of each
side and of off / before and on / off.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spread import spread  # noqa: E402
from bench.test_suite import baseline_checkout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
WARMUP = 2


def iteration_seconds(checkout: str, sanitize: bool, iters: int, cache: str,
                      scratch: str, run_id: int) -> float:
    """The median iteration time of one 2-process run of the tiny preset."""
    metrics = os.path.join(scratch, f"metrics-{run_id}.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "MEGATRON_DEVICE_SANITIZER": "1" if sanitize else "0"}
    proc = subprocess.run(
        [os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", "2",
         "pretrain_llama.py", "--model-preset", "tiny", "--pipeline-schedule", "decoupled",
         "--train-iters", str(iters), "--metrics-file", metrics, "--data-cache-dir", cache,
         "--log-interval", str(iters)],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{checkout}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    with open(metrics) as f:
        times = [json.loads(line)["iter_time_s"] for line in f if '"iter_time_s"' in line]
    return statistics.median(times[WARMUP:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit before the sanitizer")
    p.add_argument("--after", required=True, help="the commit that brought it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.iters <= WARMUP:
        p.error(f"--rounds >= 1 and --iters > {WARMUP} expected")
    scratch = tempfile.mkdtemp(prefix="bench-sanitizer-")
    cache = os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(scratch, "cache")
    trees = {}
    times: dict[str, list[float]] = {"before": [], "off": [], "on": []}
    try:
        for name, commit in (("before", args.before), ("after", args.after)):
            os.makedirs(os.path.join(scratch, name))
            trees[name] = baseline_checkout(commit, os.path.join(scratch, name))
        sides = {"before": (trees["before"], False), "off": (trees["after"], False),
                 "on": (trees["after"], True)}
        order = list(sides)
        run_id = 0
        for round_ in range(args.rounds):
            for side in order[round_ % 3:] + order[:round_ % 3]:
                checkout, sanitize = sides[side]
                run_id += 1
                seconds = iteration_seconds(checkout, sanitize, args.iters, cache, scratch,
                                            run_id)
                times[side].append(seconds)
                if not args.json:
                    print(f"round {round_ + 1}: {side} {seconds * 1000:.1f} ms per iteration",
                          file=sys.stderr)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT,
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"benchmark": "stream sanitizer, tiny preset, decoupled, 2 CPU processes",
              "before_commit": args.before, "after_commit": args.after,
              "rounds": args.rounds, "iters": args.iters,
              "iteration_s": {side: spread(values) for side, values in times.items()},
              "off_over_before": spread([o / b for o, b in zip(times["off"], times["before"])]),
              "on_over_off": spread([n / o for n, o in zip(times["on"], times["off"])]),
              "runs": times}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
