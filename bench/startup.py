"""Start-up time: from the launch of pretrain_llama.py to its first finished iteration,
against an earlier commit's, side by side on this machine.

    .venv/bin/python bench/startup.py --baseline 86000f3 --rounds 5 [--nproc 1] [--json]

Each side runs `pretrain_llama.py --model-preset tiny --train-iters 1` (under torchrun with
--nproc > 1) on the same cached demo corpus; the clock stops when the first line of the
metrics file appears. The sides alternate which goes first each round, so a load that
comes and goes on the machine falls on both; prints the median and range of each side and
of the per-round ratio (this / baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spread import spread  # noqa: E402
from bench.test_suite import baseline_checkout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


def first_iteration_seconds(checkout: str, nproc: int, cache: str, scratch: str) -> float:
    """Launch to the first metrics line; the run is then left to finish (one iteration)."""
    metrics = os.path.join(scratch, f"metrics-{time.monotonic_ns()}.jsonl")
    flags = ["--model-preset", "tiny", "--train-iters", "1", "--metrics-file", metrics,
             "--data-cache-dir", cache]
    launcher = ([os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node",
                 str(nproc)] if nproc > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([*launcher, "pretrain_llama.py", *flags], cwd=checkout, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        if proc.poll() is not None:
            raise RuntimeError(f"{checkout}: exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    proc.wait()
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun above 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.nproc < 1:
        p.error("--rounds and --nproc: expected at least 1")
    scratch = tempfile.mkdtemp(prefix="bench-startup-")
    cache = os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(scratch, "cache")
    times: dict[str, list[float]] = {"baseline": [], "this": []}
    try:
        checkouts = {"baseline": baseline_checkout(args.baseline, scratch), "this": ROOT}
        first_iteration_seconds(ROOT, 1, cache, scratch)  # builds the corpus cache once
        for round_ in range(args.rounds):
            order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
            for side in order:
                seconds = first_iteration_seconds(checkouts[side], args.nproc, cache, scratch)
                times[side].append(seconds)
                if not args.json:
                    print(f"round {round_ + 1}: {side} {seconds:.2f} s", file=sys.stderr)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force",
                        os.path.join(scratch, "baseline")], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = [t / b for t, b in zip(times["this"], times["baseline"])]
    report = {"benchmark": "startup to the first iteration, tiny preset",
              "nproc": args.nproc, "baseline_commit": args.baseline, "rounds": args.rounds,
              "baseline_s": spread(times["baseline"]), "this_s": spread(times["this"]),
              "this_over_baseline": spread(ratios), "runs": times}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
