"""The steps of `make gpu-check` that are not the cuda-marked tests, one per sub-command.

    python tools/gpu_check_steps.py large-run|sanitizer|checkpoint|profile-plan|large-model \
        --workdir DIR [--dry-run]

Each runs its training processes, prints one JSON object of figures as its last line and
exits 0 when what it checks holds, 1 when not (tools/gpu_check.py runs each in its own
process with its own time limit):
  large-run     the 1.35B LLaMA (24 x 2048, SwiGLU 5504, 16 heads, seq 2048, GBS 16, MBS 2,
                bf16), decoupled with 4 forward stages and d = 2, all model states in host
                memory, then megatron-core training the same model all on the GPU
                (bench/mcore_baseline.py, with and without full recompute): iteration
                times (median of iterations 2 on), their ratios, MFU against the datasheet;
  sanitizer     every schedule at one rank for 2 iterations (tiny preset) under torch's CUDA
                sanitizer (--device-sanitizer), the pipelines with GPU subgroup updates; as
                many at once as there are sets of 2 cores (each run on its own set);
  checkpoint    a run on the GPU saving at iteration 3, resumed from there on the CPU
                (CUDA_VISIBLE_DEVICES=""): its losses against the GPU run's;
  profile-plan  tools/profile_hardware.py on this machine, then --plan's prediction for the
                1.35B run with that profile;
  large-model   (only with `gpu_check.py --large`) LLaMA-2 7B on one GPU, model states in
                host memory with m and v in bf16 (what one H100 with 128 GiB of host memory
                trains: --plan --hardware h100-host128), 5 iterations: model TFLOP/s and MFU
                of the mean of iterations 3-5, beside --plan's prediction for it.
--dry-run prints the commands a step would run, one per line, and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.model import ModelConfig  # noqa: E402
from megatron.schedules.cost_model import megatron_model_flops_per_token  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "pretrain_llama.py")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
# Synthetic data: no corpus to build, nothing to download.
MOCK_VOCAB = 32000
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             str(MOCK_VOCAB), "--eval-iters", "0", "--log-interval", "1"]

LARGE_SHAPE = {"num_layers": 24, "hidden_size": 2048, "ffn_hidden_size": 5504,
               "num_attention_heads": 16, "num_query_groups": 16, "seq_length": 2048}
LARGE_BATCH = {"micro_batch_size": 2, "global_batch_size": 16}
LARGE_ITERS = 6  # the first is the warm-up: the median is over iterations 2-6
LARGE_RUN = [*(f"--{k.replace('_', '-')}={v}" for k, v in {**LARGE_SHAPE, **LARGE_BATCH}.items()),
             "--bf16", "--pipeline-schedule", "decoupled", "--forward-stages", "4",
             "--backward-split", "2", *MOCK_DATA]

# LLaMA-2 7B (Touvron et al. 2023): the largest released shape one H100 with 128 GiB of host
# memory trains with its states in host memory; m and v in bf16 keep the host memory it
# really takes (about 17 bytes per parameter measured with them, 21 with fp32) under 128 GiB.
LLAMA2_7B_SHAPE = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 11008,
                   "num_attention_heads": 32, "num_query_groups": 32, "seq_length": 4096}
LLAMA2_7B_BATCH = {"micro_batch_size": 1, "global_batch_size": 16}
LARGE_MODEL_ITERS = 5
LARGE_MODEL_TIMED = (3, 5)  # the iterations whose mean is timed (the first two warm up)
LARGE_MODEL_TARGET_TFLOPS = 250.0  # the goal for one H100
LARGE_MODEL_RUN = [*(f"--{k.replace('_', '-')}={v}"
                     for k, v in {**LLAMA2_7B_SHAPE, **LLAMA2_7B_BATCH}.items()),
                   "--bf16", "--optimizer-state-dtype", "bf16", "--pipeline-schedule",
                   "decoupled", *MOCK_DATA]
LARGE_MODEL_TRAIN = [*LARGE_MODEL_RUN, "--train-iters", str(LARGE_MODEL_ITERS)]
LARGE_MODEL_PROFILE = "h100-host128"

TINY = ["--model-preset", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "512", "--eval-iters", "0", "--log-interval", "1",
        "--lr-warmup-iters", "1"]
# Every schedule at one rank; the pipelines update GPU subgroups too (every 2nd on the GPU).
SCHEDULE_FLAGS = {
    "single": [],
    "gpipe": ["--optimizer-gpu-stride", "2"],
    "1f1b": ["--optimizer-gpu-stride", "2"],
    "interleaved-1f1b": ["--forward-stages", "2", "--optimizer-gpu-stride", "2"],
    "mobius": ["--forward-stages", "2", "--optimizer-gpu-stride", "2"],
    "decoupled": ["--forward-stages", "2", "--backward-split", "2",
                  "--optimizer-gpu-stride", "2"],
}
LOSS_RTOL = 1e-4  # fp32 losses, GPU against the CPU device layer


def run(argv: list[str], env: dict[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """One process from the repository root, its output kept."""
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_concurrently(jobs: dict[Hashable, Callable[[], Any]], parallel: int) -> dict[Hashable, Any]:
    """Independent runs at once (small ones share the GPU and the cores)."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def read_metrics(path: str) -> list[dict]:
    """The training iterations of a --metrics-file (not the evaluation records)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "loss" in r and "evaluation" not in r]


def train(workdir: str, name: str, flags: list[str], env: dict[str, str] | None = None,
          launcher: list[str] | None = None, timeout: float | None = None,
          ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """pretrain_llama.py with `flags`; its metrics (empty when it failed before any)."""
    metrics = metrics_path(workdir, name)
    if os.path.exists(metrics):
        os.remove(metrics)
    proc = run(train_command(workdir, name, flags, launcher), env, timeout)
    return proc, read_metrics(metrics) if os.path.exists(metrics) else []


def metrics_path(workdir: str, name: str) -> str:
    return os.path.join(workdir, f"{name}.jsonl")


def train_command(workdir: str, name: str, flags: list[str],
                  launcher: list[str] | None = None) -> list[str]:
    """What train() runs."""
    return [*(launcher or [sys.executable]), PRETRAIN, *flags, "--metrics-file",
            metrics_path(workdir, name), "--data-cache-dir", os.path.join(workdir, "cache")]


def tail(proc: subprocess.CompletedProcess, chars: int = 1500) -> str:
    return (proc.stdout + proc.stderr)[-chars:]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def large_shape() -> ModelConfig:
    # NullTokenizer adds the end-of-document token to --vocab-size; Megatron pads the rows.
    return ModelConfig(name="custom", vocab_size=MOCK_VOCAB + 1, **LARGE_SHAPE)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def large_run(workdir: str) -> tuple[bool, dict]:
    from megatron.schedules.gpu_peaks import datasheet_peak_flops

    shape = large_shape()
    proc, metrics = train(workdir, "decoupled-1.35b",
                          [*LARGE_RUN, "--train-iters", str(LARGE_ITERS)])
    figures: dict = {"decoupled": {"returncode": proc.returncode}}
    ok = proc.returncode == 0 and len(metrics) == LARGE_ITERS
    if ok:
        times = [m["iter_time_s"] for m in metrics[1:]]
        flops = megatron_model_flops_per_token(shape) * LARGE_BATCH["global_batch_size"] * shape.seq_length
        peak = datasheet_peak_flops(device_name(), "bf16")
        last = metrics[-1]
        figures["decoupled"] = {
            "iteration_s": {"median": median(times), "min": min(times), "max": max(times)},
            "iteration_times_s": [m["iter_time_s"] for m in metrics],
            "losses": [m["loss"] for m in metrics],
            "model_tflops": flops / median(times) / 1e12,
            "mfu": flops / median(times) / peak if peak else None,
            **{k: last.get(k) for k in ("device_memory_peak_bytes", "exposed_optimizer_time_s",
                                        "bubble_ratio", "host_syncs",
                                        "host_optimizer_state_bytes",
                                        "host_gradient_pool_bytes", "attention_kernel")}}
        ok = all(math.isfinite(loss) for loss in figures["decoupled"]["losses"])
    else:
        figures["decoupled"]["output_tail"] = tail(proc)
    baseline = run([sys.executable, os.path.join(ROOT, "bench", "mcore_baseline.py"),
                    *(f"--{k.replace('_', '-')}={v}" for k, v in {**LARGE_SHAPE, **LARGE_BATCH}.items()),
                    f"--vocab-size={shape.planned_vocab_size}", "--dtype", "bf16",
                    "--iters", str(LARGE_ITERS - 1), "--recompute", "none,full"])
    if baseline.returncode != 0:
        figures["megatron_core"] = {"returncode": baseline.returncode,
                                    "output_tail": tail(baseline)}
        return False, figures
    mcore = json.loads(baseline.stdout.strip().splitlines()[-1])
    figures["megatron_core"] = mcore
    ok = ok and all(math.isfinite(loss) for result in mcore["variants"].values()
                    for loss in result["losses"])
    if ok:
        ours = figures["decoupled"]["iteration_s"]["median"]
        figures["decoupled_over_megatron_core"] = {
            variant: ours / result["iteration_s"]["median"]
            for variant, result in mcore["variants"].items()}
    return ok, figures


# A run under the sanitizer gets this many cores of its own (its torch threads and the C++
# optimizer's, by affinity); as many run at once as the machine has such sets (6 of 16 cores).
SANITIZER_CORES = 2
# Starts `python ARGS...` on the cores in argv[1] (a comma list): affinity survives exec.
PIN = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
       "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def core_sets(count: int, size: int) -> list[list[int]]:
    """`count` disjoint sets of `size` of the cores this process may use (all of them each
    when there are fewer than `size`)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i * size:(i + 1) * size] if len(cores) >= size * count else cores
            for i in range(count)]


def sanitizer(workdir: str) -> tuple[bool, dict]:
    parallel = max(1, min(len(SCHEDULE_FLAGS), len(os.sched_getaffinity(0)) // SANITIZER_CORES))
    free: queue.Queue[list[int]] = queue.Queue()
    for cores in core_sets(parallel, SANITIZER_CORES):
        free.put(cores)

    def job(name: str, flags: list[str]) -> subprocess.CompletedProcess:
        cores = free.get()  # a set no running job holds
        try:
            return train(workdir, f"sanitizer-{name}",
                         [*TINY, "--pipeline-schedule", name, *flags, "--train-iters", "2",
                          "--device-sanitizer"], {"OMP_NUM_THREADS": str(len(cores))},
                         [sys.executable, "-c", PIN, ",".join(map(str, cores))])[0]
        finally:
            free.put(cores)
    jobs = {name: (lambda name=name, flags=flags: job(name, flags))
            for name, flags in SCHEDULE_FLAGS.items()}
    results = run_concurrently(jobs, parallel)
    figures = {name: {"returncode": proc.returncode,
                      **({} if proc.returncode == 0 else {"output_tail": tail(proc)})}
               for name, proc in results.items()}
    return all(proc.returncode == 0 for proc in results.values()), figures


def checkpoint(workdir: str) -> tuple[bool, dict]:
    from megatron.training.checkpointing import TRACKER

    save = os.path.join(workdir, "checkpoint")
    flags = [*TINY, "--pipeline-schedule", "decoupled", "--forward-stages", "2",
             "--backward-split", "2", "--train-iters", "6"]
    gpu, gpu_metrics = train(workdir, "checkpoint-gpu",
                             [*flags, "--save", save, "--save-interval", "3"])
    if gpu.returncode != 0:
        return False, {"gpu": {"returncode": gpu.returncode, "output_tail": tail(gpu)}}
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write("3")  # resume from the middle one, as after an interruption
    cpu, cpu_metrics = train(workdir, "checkpoint-cpu", [*flags, "--load", save], CPU_ONLY)
    if cpu.returncode != 0:
        return False, {"cpu": {"returncode": cpu.returncode, "output_tail": tail(cpu)}}
    uninterrupted = {m["iteration"]: m["loss"] for m in gpu_metrics}
    resumed = {m["iteration"]: m["loss"] for m in cpu_metrics}
    differences = {it: abs(loss - uninterrupted[it]) / abs(uninterrupted[it])
                   for it, loss in resumed.items() if it in uninterrupted}
    figures = {"gpu_losses": uninterrupted, "cpu_resumed_losses": resumed,
               "largest_relative_difference": max(differences.values(), default=None),
               "tolerance": LOSS_RTOL}
    ok = sorted(resumed) == [4, 5, 6] and all(d <= LOSS_RTOL for d in differences.values())
    return ok, figures


PROFILE_FIELDS = ("gpu_peak_flops", "efficiency_half_tokens", "pcie_bytes_per_s",
                  "d2h_bytes_per_s", "h2d_shm_bytes_per_s", "cpu_optimizer_params_per_s",
                  "host_memory_bytes_per_s", "gpu_update_params_per_s", "pass_overhead_s",
                  "backward_over_forward", "head_rate_over_layer",
                  "head_backward_over_forward", "executor_compute_over_pass",
                  "compute_spread", "datasheet_peak_flops")
PROFILES = 2  # back to back: how far two profiles of this machine, and their plans, differ


def profile_plan(workdir: str) -> tuple[bool, dict]:
    """tools/profile_hardware.py at the 1.35B run's own layer shapes (its flags), twice, and
    --plan's prediction for that run from each profile: the first is compared with the
    measured iteration, their spread says how repeatable a profile of this machine is."""
    figures: dict = {"profiles": [], "plans": []}
    for i in range(PROFILES):
        hardware = os.path.join(workdir, f"hardware-{i}.json")
        profile = run([sys.executable, os.path.join(ROOT, "tools", "profile_hardware.py"),
                       "--out", hardware, "--gpus-per-node", "1", *LARGE_RUN])  # one GPU
        if profile.returncode != 0:
            figures["profiles"].append({"returncode": profile.returncode,
                                        "output_tail": tail(profile)})
            return False, figures
        with open(hardware) as f:
            measured = json.load(f)
        figures["profiles"].append({k: measured.get(k) for k in PROFILE_FIELDS}
                                   | {"compute_shape": measured.get("compute_shape")})
        plan = run([sys.executable, PRETRAIN, *LARGE_RUN, "--plan", "--json", "--hardware",
                    hardware, "--nodes", "1", "--gpus-per-node", "1"])
        if plan.returncode not in (0, 3):  # 3: does not fit, still a prediction
            figures["plans"].append({"returncode": plan.returncode, "output_tail": tail(plan)})
            return False, figures
        configuration = json.loads(plan.stdout)["configuration"]
        figures["plans"].append({"fits": configuration["fits"],
                                 "predicted_iteration_s": configuration["predicted_iteration_s"],
                                 "mfu": configuration["mfu"], "flags": configuration["flags"]})
    predicted = [p["predicted_iteration_s"] for p in figures["plans"]]
    figures["plan"] = figures["plans"][0]
    figures["profile_file"] = os.path.join(workdir, "hardware-0.json")
    figures["predicted_spread"] = (max(predicted) - min(predicted)) / statistics.median(predicted)
    return True, figures


def llama2_7b() -> ModelConfig:
    return ModelConfig(name="custom", vocab_size=MOCK_VOCAB + 1, **LLAMA2_7B_SHAPE)


def timed_figures(metrics: list[dict], shape: ModelConfig, global_batch: int,
                  peak_flops: float | None) -> dict:
    """Model TFLOP/s and MFU of the mean iteration time of LARGE_MODEL_TIMED (iterations
    counted from 1), from a run's metrics."""
    first, last = LARGE_MODEL_TIMED
    times = [m["iter_time_s"] for m in metrics if first <= m["iteration"] <= last]
    if len(times) != last - first + 1:
        raise ValueError(f"iterations {first}-{last} are not all in the metrics")
    mean = sum(times) / len(times)
    flops = megatron_model_flops_per_token(shape) * global_batch * shape.seq_length
    return {"timed_iterations": [first, last], "iteration_s": {"mean": mean,
            "min": min(times), "max": max(times)},
            "model_tflops": flops / mean / 1e12,
            "mfu": flops / mean / peak_flops if peak_flops else None,
            "meets_target": flops / mean / 1e12 >= LARGE_MODEL_TARGET_TFLOPS,
            "target_tflops": LARGE_MODEL_TARGET_TFLOPS}


def large_model_commands(workdir: str) -> dict[str, list[str]]:
    """The plan, then the run, of the large-model step."""
    return {"plan": [sys.executable, PRETRAIN, *LARGE_MODEL_RUN, "--plan", "--json",
                     "--hardware", LARGE_MODEL_PROFILE],
            "train": train_command(workdir, "llama2-7b", LARGE_MODEL_TRAIN)}


def large_model(workdir: str) -> tuple[bool, dict]:
    from megatron.schedules.gpu_peaks import datasheet_peak_flops

    commands = large_model_commands(workdir)
    plan = run(commands["plan"])
    figures: dict = {"plan": {"returncode": plan.returncode}}
    if plan.returncode in (0, 3):
        out = json.loads(plan.stdout)
        figures["plan"] = {"profile": LARGE_MODEL_PROFILE, "fits": out["fits"],
                           **{k: out["configuration"].get(k) for k in (
                               "predicted_iteration_s", "mfu", "flags")},
                           "largest_model": out.get("largest_model")}
    proc, metrics = train(workdir, "llama2-7b", LARGE_MODEL_TRAIN)
    figures["run"] = {"returncode": proc.returncode}
    if proc.returncode != 0 or len(metrics) != LARGE_MODEL_ITERS:
        figures["run"]["output_tail"] = tail(proc)
        return False, figures
    shape = llama2_7b()
    last = metrics[-1]
    figures["run"] = {
        **timed_figures(metrics, shape, LLAMA2_7B_BATCH["global_batch_size"],
                        datasheet_peak_flops(device_name(), "bf16")),
        "iteration_times_s": [m["iter_time_s"] for m in metrics],
        "losses": [m["loss"] for m in metrics], "parameters": shape.parameters().total,
        **{k: last.get(k) for k in ("device_memory_peak_bytes", "exposed_optimizer_time_s",
                                    "bubble_ratio", "host_optimizer_state_bytes",
                                    "host_gradient_pool_bytes")}}
    return all(math.isfinite(loss) for loss in figures["run"]["losses"]), figures


STEPS: dict[str, Callable[[str], tuple[bool, dict]]] = {
    "large-run": large_run, "sanitizer": sanitizer, "checkpoint": checkpoint,
    "profile-plan": profile_plan, "large-model": large_model}
# What --dry-run prints for a step (the steps without an entry run only cuda processes)
DRY_RUN: dict[str, Callable[[str], dict[str, list[str]]]] = {"large-model": large_model_commands}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--workdir", required=True, help="runs, metrics and checkpoints go here")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands the step runs, one per line; run nothing")
    args = p.parse_args(argv)
    if args.dry_run:
        if args.step not in DRY_RUN:
            p.error(f"--dry-run: step {args.step!r} has no command list; expected one of "
                    f"{', '.join(DRY_RUN)}")
        for command in DRY_RUN[args.step](os.path.abspath(args.workdir)).values():
            print(" ".join(command))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    started = time.perf_counter()
    ok, figures = STEPS[args.step](os.path.abspath(args.workdir))
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
