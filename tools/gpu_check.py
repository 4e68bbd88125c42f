"""`make gpu-check`: what a user with a GPU machine runs first (docs/gpu-validation.md).

    python tools/gpu_check.py [--out runs/gpu-check/report.json] [--workdir runs/gpu-check]
                              [--large] [--list]

(`make gpu-check` prepares the environment first: tools/gpu_env.py.) Runs, each step in its
own process tree with its own time limit, on the CUDA device:
  cuda tests                        pytest -m cuda over the test modules that hold cuda
                                    tests (tests/test_cuda_pipeline.py: every schedule,
                                    bf16, fp16, device subgroups, a resident fraction, NVMe,
                                    2 ranks sharing the GPU, against the CPU device layer;
                                    the device layer's streams, events and pinned pools)
  1.35B decoupled vs megatron-core  the 1.35B model decoupled, states in host memory, beside
                                    megatron-core training it all on the GPU
  cuda sanitizer                    every schedule under torch's CUDA sanitizer
  gpu checkpoint resumed on the cpu a checkpoint saved on the GPU resumed on the CPU
  hardware profile and plan         tools/profile_hardware.py and --plan's prediction for
                                    the 1.35B run, beside its measured time
Their limits and the setup's budget sum to at most 7.5 minutes (time_plan(); --list and
`make gpu-check DRY_RUN=1` print them). With --large, after them and outside that budget
(up to 15 more minutes):
  LLaMA-2 7B on one GPU             the largest LLaMA-2 one H100 with 128 GiB of host
                                    memory trains, 5 iterations: model TFLOP/s of the mean
                                    of iterations 3-5, against the datasheet peak
A step that fails or runs out of time is named, and the others still run; every process a
step started ends with it (tools/process_tree.py), those it started in sessions of their
own included. Writes one JSON report (command, date, machine, versions, commit, each step's
status, time, figures and the end of its output; for the cuda tests each failed test's name
and message) and prints one verdict line. --list probes the device, prints the steps and
their limits and runs none. Exit status 0 when every step passed, 1 when one did not, 2
when there is no CUDA device to check or when started inside a check (nothing written).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_check.py"
TAIL_CHARS = 3000
# Set for every step: a check started inside one (a documented `make gpu-check` run by a
# test, say) refuses to, instead of nesting a whole check in a step's time.
INSIDE = "MEGATRON_SYSX_GPU_CHECK"
# The whole check on one H100-class GPU with 16 cores, all included: what tools/gpu_env.py
# does before the first step (probe, venv, pip from a wheel folder, the C++ build on every
# core: measured and reported, not killed) plus every step's limit.
BUDGET_S = 450
SETUP_BUDGET_S = 85
GRACE_S = 5.0  # what a step leaves running gets this long to end by itself (reapers)
FAILURE_CHARS = 2000  # of each failed test's message


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after the interpreter, run from the repository root
    timeout_s: float
    figures: str  # "json": its last stdout line is a JSON object; "junit": pytest's report
    junit: str | None = None  # where a "junit" step's pytest writes its XML report


def cuda_test_files(root: str = ROOT) -> list[str]:
    """The test modules that use `pytest.mark.cuda` (read, not imported): the cuda-tests
    step collects only these, so it needs only what they import, not what the rest of the
    suite does (tensorboard, transformers, sentencepiece, ...)."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, "tests", "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if "mark.cuda" not in text:  # the cheap look first: parsing all takes seconds
            continue
        if any(isinstance(node, ast.Attribute) and node.attr == "cuda"
               and ast.unparse(node.value) == "pytest.mark"
               for node in ast.walk(ast.parse(text, path))):
            found.append(os.path.relpath(path, root))
    return found


def default_steps(workdir: str) -> tuple[Step, ...]:
    """The check, in order. The limits are estimates until a run of this check is recorded
    (docs/gpu-validation.md says from what); with SETUP_BUDGET_S they make BUDGET_S."""
    steps = os.path.join("tools", "gpu_check_steps.py")
    junit = os.path.join(workdir, "cuda-tests.xml")
    return (
        Step("cuda tests", ("-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                            "-o", "junit_family=xunit1", f"--junitxml={junit}",
                            *cuda_test_files()), 100, "junit", junit),
        Step("1.35B decoupled vs megatron-core",
             (steps, "large-run", "--workdir", workdir), 110, "json"),
        Step("cuda sanitizer", (steps, "sanitizer", "--workdir", workdir), 40, "json"),
        Step("gpu checkpoint resumed on the cpu",
             (steps, "checkpoint", "--workdir", workdir), 35, "json"),
        Step("hardware profile and plan",
             (steps, "profile-plan", "--workdir", workdir), 75, "json"),
    )


LARGE_MODEL_STEP = "LLaMA-2 7B on one GPU"


def large_steps(workdir: str) -> tuple[Step, ...]:
    """What --large adds: minutes of setup (7B parameters and their states built in host
    memory) and 5 iterations of about 11 s on one H100."""
    return (Step(LARGE_MODEL_STEP, (os.path.join("tools", "gpu_check_steps.py"),
                                    "large-model", "--workdir", workdir), 900, "json"),)


def time_plan(steps: tuple[Step, ...], large: tuple[Step, ...] = ()) -> list[str]:
    """The budget as printed: the setup's, each step's limit, their sum against 7.5 min."""
    total = SETUP_BUDGET_S + sum(s.timeout_s for s in steps)
    lines = [f"{'setup (probe, venv, pip, C++ build)':<40} {SETUP_BUDGET_S:4.0f} s "
             "(measured, not killed)"]
    lines += [f"{s.name:<40} {s.timeout_s:4.0f} s" for s in steps]
    lines.append(f"{'total':<40} {total:4.0f} s = {total / 60:.1f} min (at most "
                 f"{BUDGET_S / 60:.1f})")
    lines += [f"{s.name:<40} {s.timeout_s:4.0f} s (--large: after the total)" for s in large]
    return lines


def run_step(step: Step) -> dict:
    """`step` in a fresh interpreter under tools/process_tree.py, in a session of its own:
    status, wall time, figures, the end of its output. Out of time, or done, every process
    it started is ended (what it left running fails it)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-step-") as tmp:
        status_file = os.path.join(tmp, "status.json")
        if step.junit and os.path.exists(step.junit):
            os.remove(step.junit)  # a previous run's report is not this one's
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "process_tree.py"), "--timeout",
             str(step.timeout_s), "--grace", str(GRACE_S), "--status", status_file, "--",
             sys.executable, *step.argv],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, INSIDE: "1"})
        try:  # the watcher ends the step in time; this is the last resort
            out, _ = proc.communicate(timeout=step.timeout_s + GRACE_S + 30)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the watcher ends the tree as on its own time-out
            try:
                out, _ = proc.communicate(timeout=GRACE_S + 10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
        except BaseException:  # Ctrl-C: the tree ends what the step started
            proc.terminate()
            proc.wait()
            raise
        try:
            with open(status_file) as f:
                outcome = json.load(f)
        except (OSError, json.JSONDecodeError):
            outcome = {"returncode": proc.returncode, "timed_out": False, "left_running": []}
    left = outcome["left_running"]
    if outcome["timed_out"]:
        status = f"out of time ({step.timeout_s:.0f} s)"
    elif outcome["returncode"] != 0:
        status = f"failed (exit status {outcome['returncode']})"
    elif left:
        status = f"failed (left {len(left)} process(es) running, killed)"
    else:
        status = "passed"
    result = {"step": step.name, "command": " ".join(["python", *step.argv]),
              "status": status, "passed": status == "passed",
              "seconds": round(time.monotonic() - started, 1), "time_limit_s": step.timeout_s,
              "figures": None, "output_tail": out[-TAIL_CHARS:],
              **({"left_running": left} if left else {})}
    figures = junit_figures(step.junit) if step.figures == "junit" else last_json(out)
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


def junit_figures(path: str | None) -> dict | None:
    """pytest's JUnit XML report as counts, each failed or erroring test's name and message
    (the assertion and its explanation lines), and the skip reasons; None without one."""
    try:
        root = ET.parse(path).getroot() if path else None
    except (OSError, ET.ParseError):
        return None
    if root is None:
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skip_reasons = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            kind = "failed" if problem.tag == "failure" else "errors"
            counts[kind] += 1
            explanation = [line for line in (problem.text or "").splitlines()
                           if line.startswith("E ")]
            failures.append({"test": name, "kind": problem.tag, "message": "\n".join(
                [problem.get("message", ""), *explanation])[:FAILURE_CHARS]})
        elif skipped is not None:
            counts["skipped"] += 1
            skip_reasons.append(f"{name}: {skipped.get('message', '')}")
        else:
            counts["passed"] += 1
    return {**counts, **({"failures": failures} if failures else {}),
            **({"skip_reasons": skip_reasons} if skip_reasons else {})}


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
    out.update({f"{side}_attention_kernel": kernel
                for side, kernel in attention_kernels(large).items()})
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


def attention_kernels(large: dict) -> dict[str, str]:
    """The attention kernel each side of the 1.35B comparison ran, where its figures name
    one (`attention_kernel`: the decoupled run's metrics, megatron-core's baseline, whole
    or per variant); sides that name none are left out."""
    mcore = large.get("megatron_core", {})
    found = {"decoupled": large.get("decoupled", {}).get("attention_kernel"),
             "megatron_core": mcore.get("attention_kernel"),
             **{f"megatron_core_{variant}_recompute": result.get("attention_kernel")
                for variant, result in mcore.get("variants", {}).items()}}
    return {side: kernel for side, kernel in found.items() if kernel}


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
    kernels = {k[:-len("_attention_kernel")]: v for k, v in figures.items()
               if k.endswith("_attention_kernel")}
    if len(set(kernels.values())) > 1:  # the ratios then compare two attention kernels
        parts.append("attention kernels differ: " + ", ".join(
            f"{side} {kernel}" for side, kernel in kernels.items()))
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


def commit(root: str = ROOT) -> str:
    """HEAD of the repository `root` is the top of, marked when the working tree differs
    from it; "unknown" without git, and in an unpacked archive (no .git of its own), never
    the commit of some repository around it."""
    git = shutil.which("git")
    if git is None or not os.path.exists(os.path.join(root, ".git")):
        return "unknown"

    def ask(*args: str) -> str:
        return subprocess.run([git, "-C", root, *args], capture_output=True,
                              text=True).stdout.strip()

    head = ask("rev-parse", "HEAD")
    if not head:
        return "unknown"
    dirty = ask("status", "--porcelain", "--untracked-files=no")
    return head + ("+uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None, steps: tuple[Step, ...] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "gpu-check", "report.json"),
                   help="where the JSON report goes")
    p.add_argument("--workdir", default=None,
                   help="the steps' runs, metrics and checkpoints (default: beside --out)")
    p.add_argument("--large", action="store_true",
                   help="also train LLaMA-2 7B on one GPU for 5 iterations (up to 15 more "
                        "minutes)")
    p.add_argument("--list", action="store_true",
                   help="probe the device, print the steps and their limits, run none")
    args = p.parse_args(argv)
    if os.environ.get(INSIDE):
        print(f"{PROG}: error: started inside a gpu-check ({INSIDE}={os.environ[INSIDE]}): "
              "expected to be run alone; a check does not run itself", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device is visible (torch {torch.__version__}, CUDA "
              f"build {torch.version.cuda}): expected a GPU machine; without one, `make "
              "test` is the whole check", file=sys.stderr)
        return 2
    workdir = os.path.abspath(args.workdir or os.path.join(os.path.dirname(args.out) or ".",
                                                           "work"))
    if steps is None:
        steps = default_steps(workdir) + (large_steps(workdir) if args.large else ())
    if args.list:
        print(f"gpu-check: {', '.join(gpu_names())}; torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}; commit: {commit()}")
        print("gpu-check: the steps and their time limits (none run):")
        large = tuple(s for s in steps if s.name == LARGE_MODEL_STEP)
        for line in time_plan(tuple(s for s in steps if s not in large), large):
            print(f"  {line}")
        return 0
    started = time.monotonic()
    setup_s = os.environ.get("GPU_CHECK_SETUP_S")
    report = {"command": os.environ.get("GPU_CHECK_COMMAND",
                                        " ".join(["python", "tools/gpu_check.py", *(argv or sys.argv[1:])])),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(),
              "setup_seconds": float(setup_s) if setup_s else None, "steps": []}
    for step in steps:
        result = run_step(step)
        report["steps"].append(result)
        print(f"gpu-check: {step.name}: {result['status']} ({result['seconds']:.0f} s)",
              flush=True)
        for failure in (result["figures"] or {}).get("failures", [])[:10]:
            print(f"  {failure['kind']}: {failure['test']}: "
                  f"{failure['message'].splitlines()[0] if failure['message'] else ''}")
    report["summary"] = summary(report["steps"])
    report["seconds"] = round(time.monotonic() - started, 1)
    report["verdict"] = verdict(report["steps"], report["machine"]["gpus"], report["summary"],
                                report["seconds"] + (report["setup_seconds"] or 0), args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(report["verdict"])
    return 0 if all(s["passed"] for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
