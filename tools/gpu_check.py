"""`make gpu-check`: what a user with a GPU machine runs first.

    python tools/gpu_check.py [--out runs/gpu-check/report.json] [--timeout 1800]

Runs, on the CUDA device: the cuda-marked tests (the device layer's streams, events and
pinned pools on CUDA, page-locked shared-memory segments, and the decoupled pipeline on the
GPU against the same run on the CPU device layer), then the offload and CPU-optimizer
benchmarks. Writes one JSON report (machine, versions, each step's status, time and
figures) and prints a one-line verdict; exit status 0 when every step passed, 1 when one
failed, 2 when there is no CUDA device to check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_check.py"

# (name, command after the interpreter, whether its stdout is one JSON object)
STEPS = (
    ("cuda tests", ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"], False),
    ("offload benchmark", ["bench/offload.py", "--device", "cuda", "--json"], True),
    ("cpu optimizer benchmark", ["bench/cpu_adam.py", "--json"], True),
)


def machine() -> dict:
    """What the report was measured on."""
    import torch

    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True)
    return {
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "commit": git.stdout.strip() or None,
    }


def run_step(name: str, args: list[str], json_output: bool, timeout: float) -> dict:
    """One step in a fresh interpreter: its status, wall time, output's end and figures."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        status, out, err = "timeout", "", f"no result after {timeout:.0f} s"
    step = {"step": name, "command": " ".join(["python", *args]), "status": status,
            "seconds": round(time.monotonic() - t0, 1), "passed": status == 0,
            "output_tail": (out + err)[-2000:]}
    if json_output and status == 0:
        try:
            step["figures"] = json.loads(out)
        except json.JSONDecodeError:
            step["passed"], step["status"] = False, "its output is not one JSON object"
    return step


def verdict(steps: list[dict], gpus: list[str]) -> str:
    failed = [s["step"] for s in steps if not s["passed"]]
    if failed:
        return f"gpu-check: FAILED ({', '.join(failed)}): see the report's output_tail"
    return f"gpu-check: passed ({len(steps)} steps on {', '.join(gpus)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "gpu-check", "report.json"),
                   help="where the JSON report goes")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device is visible (torch {torch.__version__}, CUDA "
              f"build {torch.version.cuda}): expected a GPU machine; without one, `make "
              "test` is the whole check", file=sys.stderr)
        return 2
    report = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "steps": []}
    for name, step_args, json_output in STEPS:
        report["steps"].append(run_step(name, step_args, json_output, args.timeout))
    report["verdict"] = verdict(report["steps"], report["machine"]["gpus"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{report['verdict']}; report: {args.out}")
    return 0 if all(s["passed"] for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
