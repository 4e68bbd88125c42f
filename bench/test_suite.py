"""The test suite's wall time against an earlier commit's, side by side on this machine.

    .venv/bin/python bench/test_suite.py --baseline 6d9789b --rounds 3 [--json]

Each side runs what its `make test` runs after ruff (tests/run_suite.py where it has one,
else one pytest session). The baseline is checked out in a temporary git worktree that shares this checkout's .venv
and built C++ extension (the same sources are compiled in both); the two suites then run
one after the other, alternating which goes first each round, so that a load that comes
and goes on the machine falls on both. Prints the wall time of every run, the median and
range of each side and of the per-round ratio, and the counts of tests pytest reported.
Beside the wall time, each run's CPU seconds (user + system of the suite and every process
it started and waited for): the suite is CPU-bound on 2 cores, and CPU time moves less than
wall time with the machine's load.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spread import spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"(\d+) passed(?:, (\d+) skipped)?")


def suite_command(checkout: str) -> list[str]:
    """What `make test` runs after ruff in `checkout`: tests/run_suite.py (both tiers at
    once) where the checkout has it, else one pytest session."""
    if os.path.exists(os.path.join(checkout, "tests", "run_suite.py")):
        return [sys.executable, "tests/run_suite.py"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def run_suite(checkout: str) -> dict:
    """The suite in `checkout`: wall and CPU time, exit status and the tests every session's
    summary line counts."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(suite_command(checkout), cwd=checkout, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    found = [SUMMARY.search(line) for line in proc.stdout.splitlines()
             if re.search(r" in [\d.]+s", line)]
    found = [f for f in found if f]
    return {"seconds": seconds, "cpu_seconds": cpu, "returncode": proc.returncode,
            "passed": sum(int(f.group(1)) for f in found),
            "skipped": sum(int(f.group(2) or 0) for f in found),
            # what failed, so that a failing side says which tests
            "failed": [line for line in proc.stdout.splitlines()
                       if line.startswith(("FAILED ", "ERROR "))]}


def baseline_checkout(commit: str, into: str) -> str:
    """`commit` as a worktree under `into`, with this checkout's built extension."""
    path = os.path.join(into, "baseline")
    subprocess.run(["git", "worktree", "add", "--detach", path, commit], cwd=ROOT,
                   check=True, capture_output=True)
    for built in glob.glob(os.path.join(ROOT, "megatron", "optimizer", "*.so")):
        shutil.copy(built, os.path.join(path, "megatron", "optimizer"))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected at least 1")
    scratch = tempfile.mkdtemp(prefix="bench-suite-")
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    try:
        checkouts = {"baseline": baseline_checkout(args.baseline, scratch), "this": ROOT}
        for round_ in range(args.rounds):
            order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
            for side in order:
                result = run_suite(checkouts[side])
                runs[side].append(result)
                if not args.json:
                    print(f"round {round_ + 1}: {side} {result['seconds']:.1f} s "
                          f"({result['cpu_seconds']:.0f} CPU s), "
                          f"{result['passed']} passed, rc {result['returncode']}",
                          file=sys.stderr)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force",
                        os.path.join(scratch, "baseline")], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    pairs = list(zip(runs["this"], runs["baseline"]))
    result = {
        "baseline": args.baseline, "rounds": args.rounds, "cores": os.cpu_count(),
        "seconds": {side: spread([r["seconds"] for r in rs]) for side, rs in runs.items()},
        "this_over_baseline": spread([t["seconds"] / b["seconds"] for t, b in pairs]),
        "cpu_seconds": {side: spread([r["cpu_seconds"] for r in rs])
                        for side, rs in runs.items()},
        "cpu_this_over_baseline": spread([t["cpu_seconds"] / b["cpu_seconds"] for t, b in pairs]),
        "runs": runs,
    }
    print(json.dumps(result, indent=None if args.json else 1))
    return 0 if all(r["returncode"] == 0 for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
