"""`make gpu-check`: what a user with a GPU machine runs first (docs/gpu-validation.md).

    python tools/gpu_check.py [--out runs/gpu-check/report.json] [--workdir runs/gpu-check]
                              [--large]

(`make gpu-check` prepares the environment first: tools/gpu_env.py.) Runs, each step in its
own process with its own time limit, on the CUDA device:
  cuda tests                        pytest -m cuda (tests/test_cuda_pipeline.py: every
                                    schedule, bf16, fp16, device subgroups, a resident
                                    fraction, NVMe, one process, 2 ranks sharing the GPU,
                                    against the CPU device layer; the device layer on CUDA)
  1.35B decoupled vs megatron-core  the 1.35B model decoupled, states in host memory, beside
                                    megatron-core training it all on the GPU
  cuda sanitizer                    every schedule under torch's CUDA sanitizer
  gpu checkpoint resumed on the cpu a checkpoint saved on the GPU resumed on the CPU
  hardware profile and plan         tools/profile_hardware.py and --plan's prediction for
                                    the 1.35B run, beside its measured time
and with --large, after them and outside their 8 minutes (up to 15 more):
  LLaMA-2 7B on one GPU             the largest LLaMA-2 one H100 with 128 GiB of host
                                    memory trains, 5 iterations: model TFLOP/s of the mean
                                    of iterations 3-5, against the datasheet peak
A step that fails or runs out of time is named, and the others still run. Writes one JSON
report (command, date, machine, versions, commit, each step's status, time, figures and the
end of its output) and prints one verdict line. Exit status 0 when every step passed, 1
when one did not, 2 when there is no CUDA device to check (nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_check.py"
TAIL_CHARS = 3000


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after the interpreter, run from the repository root
    timeout_s: float
    figures: str  # "json": its last stdout line is a JSON object; "pytest": the summary line


def default_steps(workdir: str) -> tuple[Step, ...]:
    """The check, in order. The limits sum to 7.9 minutes; on one H100 the steps take
    about half of theirs."""
    steps = os.path.join("tools", "gpu_check_steps.py")
    return (
        Step("cuda tests", ("-m", "pytest", "-m", "cuda", "-q", "-rs", "-p",
                            "no:cacheprovider"), 135, "pytest"),
        Step("1.35B decoupled vs megatron-core",
             (steps, "large-run", "--workdir", workdir), 130, "json"),
        Step("cuda sanitizer", (steps, "sanitizer", "--workdir", workdir), 60, "json"),
        Step("gpu checkpoint resumed on the cpu",
             (steps, "checkpoint", "--workdir", workdir), 45, "json"),
        Step("hardware profile and plan",
             (steps, "profile-plan", "--workdir", workdir), 105, "json"),
    )


LARGE_MODEL_STEP = "LLaMA-2 7B on one GPU"


def large_steps(workdir: str) -> tuple[Step, ...]:
    """What --large adds: minutes of setup (7B parameters and their states built in host
    memory) and 5 iterations of about 11 s on one H100."""
    return (Step(LARGE_MODEL_STEP, (os.path.join("tools", "gpu_check_steps.py"),
                                    "large-model", "--workdir", workdir), 900, "json"),)


def run_step(step: Step) -> dict:
    """`step` in a fresh interpreter and its own process group (a step out of time is killed
    with every process it started): status, wall time, figures, the end of its output."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, *step.argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=step.timeout_s)
        status = "passed" if proc.returncode == 0 else f"failed (exit status {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = f"out of time ({step.timeout_s:.0f} s)"
    result = {"step": step.name, "command": " ".join(["python", *step.argv]),
              "status": status, "passed": status == "passed",
              "seconds": round(time.monotonic() - started, 1), "time_limit_s": step.timeout_s,
              "figures": None, "output_tail": out[-TAIL_CHARS:]}
    figures = pytest_counts(out) if step.figures == "pytest" else last_json(out)
    if figures is None and result["passed"]:
        result["passed"], result["status"] = False, "failed (no figures in its output)"
    result["figures"] = figures
    return result


def last_json(out: str) -> dict | None:
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def pytest_counts(out: str) -> dict | None:
    """pytest's last summary line as counts ('3 passed, 1 skipped in 9.1s')."""
    summaries = [line for line in out.splitlines() if re.search(r" in [\d.]+s", line)]
    if not summaries:
        return None
    counts = {word: int(n) for n, word in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", summaries[-1])}
    skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", out, re.MULTILINE)
    return {**counts, **({"skip_reasons": skipped} if skipped else {})}


def summary(steps: list[dict]) -> dict:
    """The figures a reader compares: decoupled against megatron-core, the plan against the
    measured time."""
    figures = {s["step"]: s["figures"] or {} for s in steps}
    large = figures.get("1.35B decoupled vs megatron-core", {})
    out: dict = {}
    ours = large.get("decoupled", {}).get("iteration_s", {}).get("median")
    if ours is not None:
        out["decoupled_iteration_s"] = ours
        out["decoupled_mfu"] = large["decoupled"].get("mfu")
    for variant, result in large.get("megatron_core", {}).get("variants", {}).items():
        out[f"megatron_core_{variant}_recompute_iteration_s"] = result["iteration_s"]["median"]
        out[f"megatron_core_{variant}_recompute_mfu"] = result.get("mfu")
        if ours is not None:
            out[f"decoupled_over_megatron_core_{variant}_recompute"] = (
                ours / result["iteration_s"]["median"])
    large_model = figures.get(LARGE_MODEL_STEP, {}).get("run", {})
    if "model_tflops" in large_model:
        out["llama2_7b_model_tflops"] = large_model["model_tflops"]
        out["llama2_7b_mfu"] = large_model.get("mfu")
    profile_plan = figures.get("hardware profile and plan", {})
    predicted = profile_plan.get("plan", {}).get("predicted_iteration_s")
    if predicted is not None:
        out["plan_predicted_iteration_s"] = predicted
        # two profiles back to back: (max - min) / median of their plans' predictions
        out["plan_predicted_spread_between_profiles"] = profile_plan.get("predicted_spread")
        if ours is not None:
            out["plan_predicted_over_measured"] = predicted / ours
    return out


def verdict(steps: list[dict], gpus: list[str], figures: dict, seconds: float, out: str) -> str:
    failed = [s["step"] for s in steps if not s["passed"]]
    head = (f"gpu-check: FAILED ({', '.join(failed)})" if failed else "gpu-check: passed")
    parts = [f"{head}: {len(steps) - len(failed)} of {len(steps)} steps passed in "
             f"{seconds / 60:.1f} min on {', '.join(gpus) or 'no GPU'}"]
    if "decoupled_iteration_s" in figures:
        ratios = [f"megatron-core {figures[f'megatron_core_{v}_recompute_iteration_s']:.2f} s "
                  f"{v} recompute (x{figures[f'decoupled_over_megatron_core_{v}_recompute']:.2f})"
                  for v in ("none", "full")
                  if f"decoupled_over_megatron_core_{v}_recompute" in figures]
        parts.append(f"1.35B decoupled {figures['decoupled_iteration_s']:.2f} s/iteration"
                     + (f" against {', '.join(ratios)}" if ratios else ""))
    if "llama2_7b_model_tflops" in figures:
        parts.append(f"LLaMA-2 7B {figures['llama2_7b_model_tflops']:.0f} TFLOP/s of model "
                     "flops (iterations 3-5)")
    parts.append(f"report: {out}")
    return "; ".join(parts)


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict:
    """What the report was measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "gpus": gpu_names(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "megatron_core": _distribution_version("megatron-core")}


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def commit() -> str | None:
    """HEAD, marked when the working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (head + ("+uncommitted changes" if dirty else "")) or None


def main(argv: list[str] | None = None, steps: tuple[Step, ...] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "gpu-check", "report.json"),
                   help="where the JSON report goes")
    p.add_argument("--workdir", default=None,
                   help="the steps' runs, metrics and checkpoints (default: beside --out)")
    p.add_argument("--large", action="store_true",
                   help="also train LLaMA-2 7B on one GPU for 5 iterations (up to 15 more "
                        "minutes)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device is visible (torch {torch.__version__}, CUDA "
              f"build {torch.version.cuda}): expected a GPU machine; without one, `make "
              "test` is the whole check", file=sys.stderr)
        return 2
    workdir = os.path.abspath(args.workdir or os.path.join(os.path.dirname(args.out) or ".",
                                                           "work"))
    started = time.monotonic()
    report = {"command": os.environ.get("GPU_CHECK_COMMAND",
                                        " ".join(["python", "tools/gpu_check.py", *(argv or sys.argv[1:])])),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "steps": []}
    if steps is None:
        steps = default_steps(workdir) + (large_steps(workdir) if args.large else ())
    for step in steps:
        result = run_step(step)
        report["steps"].append(result)
        print(f"gpu-check: {step.name}: {result['status']} ({result['seconds']:.0f} s)",
              flush=True)
    report["summary"] = summary(report["steps"])
    report["seconds"] = round(time.monotonic() - started, 1)
    report["verdict"] = verdict(report["steps"], report["machine"]["gpus"], report["summary"],
                                report["seconds"], args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(report["verdict"])
    return 0 if all(s["passed"] for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
