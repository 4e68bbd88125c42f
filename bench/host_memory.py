"""Host memory of a pipeline run by category, from the kernel's view, beside the plan's.

    .venv/bin/python bench/host_memory.py [--nproc 2] [--iterations 3]
        [--load same|resharded|none] [--json] [--out DIR] [-- pretrain_llama.py flags]

Runs `pretrain_llama.py`'s training (`train()`) on --nproc CPU processes under torchrun,
saves a checkpoint at the end (synchronously, unless the flags say --async-save), then
starts again from it (--load same: the same shape; resharded: 1F1B with a forward stage
per process, so every process reads parts of other processes' files), and reports:

- per process and in total, after the first launch's last iteration, the bytes the kernel
  says are resident, by category: `shm_parameters` (the /dev/shm segments: in total the
  job's files, per process its proportional share, Pss_Shmem), `master`, `exp_avg`,
  `exp_avg_sq` (the CPU AdamW's tensors), `host_gradients` (the buffers the gradient pool
  holds: pinned on CUDA), the `process_baseline` (RssAnon of the process once torch and
  megatron-core are imported, before anything else), the CPU device layer's own bytes
  (`device_buffers`: the slots, gradient buffers and scratch the layer handed out, the
  pages written of them, and `device_buffers_allocated`, their size, as a GPU holds them;
  `device_activations_peak`: the executor's book, transient within an iteration), and
  what is left of the process's anonymous memory (`other`; `malloc_free`: what glibc's
  malloc counts as free in its heaps, some of it returned to the kernel). Each tensor
  category is measured with mincore(2) over the tensors' pages (resident bytes, not
  sizes) and printed beside the memory model's figure (the baseline's: the --hardware
  profile's, when the flags name one);
- `host_tier_bytes_per_param`: shared memory, master, m, v and gradients over the model's
  parameters: what a GPU host holds per parameter (the baseline and the CPU device
  layer's own bytes apart);
- per launch, over time (sampled every 20 ms by this process: RssAnon of every rank plus
  the job's /dev/shm files), the peak of the total in each phase (start-up, checkpoint
  load, first iteration, steady state, checkpoint save, end) and the highest over the
  steady state's (`peak_over_steady`); per process the kernel's own peak resident size
  of each phase (VmHWM, restarted at every phase boundary: file pages and mapped shared
  memory included), so that no peak between two samples goes unseen.

Default model: the 0.54B shape (LLaMA, 8 layers x 2048, SwiGLU 5504, 16 heads, vocabulary
32000, bf16 with --optimizer-state-dtype bf16 and --grad-reduce-in-bf16: 12 bytes per
parameter of host tier) with few tokens per iteration (the states' memory does not depend
on them); flags after `--` replace any default of the same name.
At the default shape, 2 processes hold about 10 GB and the checkpoint takes 4.3 GB of
disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
SHAPE_054B = {"--num-layers": "8", "--hidden-size": "2048", "--ffn-hidden-size": "5504",
              "--num-attention-heads": "16", "--seq-length": "32", "--micro-batch-size": "1",
              "--global-batch-size": "4", "--mock-data": None, "--tokenizer-type": "NullTokenizer",
              "--vocab-size": "32000", "--bf16": None, "--optimizer-state-dtype": "bf16",
              "--grad-reduce-in-bf16": None,
              "--pipeline-schedule": "decoupled", "--eval-iters": "0", "--log-interval": "1"}
PHASES = ("start-up", "checkpoint load", "first iteration", "steady state", "checkpoint save",
          "end")
SAMPLE_S = 0.02


# --- the worker: one rank under torchrun ------------------------------------------------

def worker(out_dir: str, flags: list[str]) -> int:
    from megatron.common.process_memory import memory_status, reset_peak
    from megatron.offload.naming import job_prefix, resolve_job_id
    from megatron.training import training
    from megatron.training.arguments import parse_args
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    baseline = memory_status()  # torch and megatron-core imported, nothing else done
    rank = int(os.environ["RANK"])
    peaks: dict[str, int] = {}
    marks: list[tuple[float, str]] = []
    state = {"phase": None}

    def enter(phase: str) -> None:
        if state["phase"] is not None:
            peaks[state["phase"]] = max(peaks.get(state["phase"], 0), memory_status()["peak"])
        reset_peak()
        state["phase"] = phase
        marks.append((time.time(), phase))
        with open(os.path.join(out_dir, f"phase_{rank}"), "a") as f:
            f.write(f"{time.time()} {phase}\n")

    with open(os.path.join(out_dir, f"pid_{rank}"), "w") as f:
        # the pid, and the prefix of this job's segments (the box's other jobs have theirs)
        f.write(f"{os.getpid()} {job_prefix(resolve_job_id())}")
    enter("start-up")
    run = parse_args(flags)
    snapshot: dict = {}
    loop_class = training.TrainingLoop

    def wrapped(method, phase: str, after: str):
        def call(self, *a, **kw):
            enter(phase)
            try:
                return method(self, *a, **kw)
            finally:
                enter(after)
        return call

    loop_class._load = wrapped(loop_class._load, "checkpoint load", "start-up")
    loop_class.save = wrapped(loop_class.save, "checkpoint save", "steady state")

    def on_step(step) -> None:
        original, count = step.step, [0]

        def measured(*a, **kw):
            count[0] += 1
            enter("first iteration" if count[0] == 1 else "steady state")
            result = original(*a, **kw)
            if count[0] > 1:
                snapshot.update(categories(step.pipeline, baseline["anon"]))
            return result
        step.step = measured

    dist_info = initialize_distributed()
    try:
        training.train(run, dist_info, on_step=on_step)
    finally:
        shutdown_distributed()
    enter("end")
    peaks["end"] = memory_status()["peak"]
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "baseline_anon": baseline["anon"], "phase_peaks": peaks,
                   "categories": snapshot, "marks": marks}, f)
    return 0


def categories(pipeline, baseline_anon: int) -> dict:
    """This process's resident bytes by category, from mincore over each category's
    tensors, and the rest of its anonymous memory."""
    from megatron.common.process_memory import malloc_free_bytes, memory_status, resident_bytes

    adam = pipeline.cpu_adam
    states = [adam.states(g) for g in range(adam.num_groups)]
    tensors = {"master": [s[0] for s in states], "exp_avg": [s[1] for s in states],
               "exp_avg_sq": [s[2] for s in states],
               "host_gradients": pipeline.buffers.host_pool.buffers(),
               "device_buffers": pipeline.device.live_buffers()}
    measured = {name: resident_bytes(storage_spans(ts)) for name, ts in tensors.items()}
    status = memory_status()
    measured["process_baseline"] = baseline_anon
    measured["other"] = status["anon"] - sum(measured.values())
    measured["malloc_free"] = malloc_free_bytes()
    measured["shm_parameters_mapped"] = status["shmem"]
    measured["shm_parameters"] = smaps_pss_shmem()
    measured["anon"] = status["anon"]
    measured["books"] = {"host_gradient_pool_bytes": pipeline.buffers.host_pool.allocated_bytes,
                         "host_optimizer_state_bytes": adam.host_state_bytes(),
                         "device_bytes": pipeline.device.device_bytes,
                         "device_memory_peak_bytes": pipeline.device.memory.peak_bytes,
                         "device_memory_at_peak": pipeline.device.memory.peak_breakdown}
    return measured


def storage_spans(tensors) -> list[tuple[int, int]]:
    """The (address, bytes) of each host tensor's whole storage (a view counts its base)."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
            if t.device.type == "cpu"]


def smaps_pss_shmem(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss_Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


# --- the driver ---------------------------------------------------------------------------

def with_defaults(defaults: dict[str, str | None], given: list[str]) -> list[str]:
    """`given` plus every default flag it does not name."""
    out = []
    for flag, value in defaults.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out + given


class Sampler:
    """RssAnon of the ranks and the job's /dev/shm bytes every SAMPLE_S, with the time."""

    def __init__(self, out_dir: str, nproc: int) -> None:
        self.out_dir, self.nproc = out_dir, nproc
        self.samples: list[tuple[float, int, int]] = []  # (time, sum of RssAnon, shm)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _ranks(self) -> list[tuple[int, str]]:
        """(pid, segment prefix) of each rank that has written its file."""
        ranks = []
        for r in range(self.nproc):
            try:
                with open(os.path.join(self.out_dir, f"pid_{r}")) as f:
                    pid, prefix = f.read().split()
                ranks.append((int(pid), prefix))
            except (OSError, ValueError):
                pass
        return ranks

    def _run(self) -> None:
        from megatron.common.process_memory import memory_status

        ranks: list[tuple[int, str]] = []
        while not self._stop.wait(SAMPLE_S):
            if len(ranks) < self.nproc:
                ranks = self._ranks()
                continue
            anon = 0
            for pid, _ in ranks:
                try:
                    anon += memory_status(pid).get("anon", 0)  # 0: exited
                except OSError:
                    pass
            self.samples.append((time.time(), anon, job_shm_bytes(ranks[0][1])))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def job_shm_bytes(prefix: str) -> int:
    """Allocated bytes of the job's segments in /dev/shm (names starting with `prefix`)."""
    total = 0
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(prefix):
            try:
                total += entry.stat().st_blocks * 512
            except OSError:
                pass
    return total


def launch(nproc: int, flags: list[str], out_dir: str) -> dict:
    """One torchrun of the workers; their reports and the samples, by phase."""
    os.makedirs(out_dir, exist_ok=True)
    sampler = Sampler(out_dir, nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--worker", out_dir, "--", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    sampler.stop()
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-3000:]}")
    ranks = []
    for r in range(nproc):
        with open(os.path.join(out_dir, f"rank_{r}.json")) as f:
            ranks.append(json.load(f))
    marks = sorted((t, phase) for rank in ranks for t, phase in rank["marks"])
    by_phase: dict[str, int] = {}
    for t, anon, shm in sampler.samples:
        phase = phase_at(t, marks)
        by_phase[phase] = max(by_phase.get(phase, 0), anon + shm)
    return {"ranks": ranks, "peak_by_phase": by_phase,
            "shm_bytes": max((s[2] for s in sampler.samples), default=0)}


def phase_at(t: float, marks: list[tuple[float, str]]) -> str:
    """The phase of the latest mark at or before `t` (any rank's: the ranks move through
    the phases together, within a collective)."""
    phase = "start-up"
    for when, name in marks:
        if when > t:
            break
        phase = name
    return phase


def plan_figures(flags: list[str], nproc: int) -> tuple[list[dict], int, int]:
    """The memory model's figures for this run, per process: (rows, parameters, shm). The
    baseline is the --hardware profile's, when the flags name one (None: no figure)."""
    from megatron.config.run import DTYPE_BYTES
    from megatron.planning.evaluate import plan_hardware
    from megatron.planning.run_plan import run_start
    from megatron.training.arguments import parse_args

    run = parse_args(flags)
    vocab = run.model.vocab_size
    plan = run_start(run, nproc, nproc, on_cuda=False).memory  # what the trainer plans
    baseline = plan_hardware(run).process_baseline_bytes if run.planning.hardware else None
    params = replace(run.model, vocab_size=vocab).parameters().total
    p = run.precision
    rows = []
    for rank in range(nproc):
        host, gpu = plan.per_process[rank], plan.per_gpu[rank]
        owned = host["optimizer_states"] // p.optimizer_bytes_per_param
        rows.append({"master": owned * DTYPE_BYTES[p.master_dtype],
                     "exp_avg": owned * DTYPE_BYTES[p.optimizer_state_dtype],
                     "exp_avg_sq": owned * DTYPE_BYTES[p.optimizer_state_dtype],
                     "host_gradients": host["host_gradients"],
                     "device_buffers_allocated": gpu["parameter_slots"]
                     + gpu["gradient_buffers"] + gpu["optimizer_subgroups"],
                     "device_activations_peak": gpu["activation_checkpoints"]
                     + gpu["activations"],
                     "process_baseline": baseline})
    return rows, params, plan.per_node[0]["shm_parameters"]


HOST_TIER = ("master", "exp_avg", "exp_avg_sq", "host_gradients")


def ratio(plan: int | None, measured: int | None) -> float | None:
    return plan / measured if plan is not None and measured else None


def phases_of(launch: dict) -> dict:
    """A launch's peak total by phase, its steady state's and the highest over it."""
    by_phase = launch["peak_by_phase"]
    steady = by_phase.get("steady state")
    phase, peak = max(by_phase.items(), key=lambda kv: kv[1])
    return {"peak_total_by_phase": by_phase, "steady_state_total": steady, "peak_total": peak,
            "peak_phase": phase, "peak_over_steady": peak / steady if steady else None,
            "vmhwm_by_phase_per_process": [r["phase_peaks"] for r in launch["ranks"]]}


def report(launches: dict[str, dict], flags: list[str], nproc: int) -> dict:
    """Categories from the first launch's steady state (the flags' shape) beside the plan;
    every launch's phases."""
    plan_rows, params, plan_shm = plan_figures(flags, nproc)
    first = next(iter(launches.values()))
    per_process = []
    for rank, row in enumerate(first["ranks"]):
        books = row["categories"]["books"]
        measured = {k: v for k, v in row["categories"].items() if k != "books"}
        measured["device_buffers_allocated"] = books["device_bytes"]
        measured["device_activations_peak"] = sum(
            v for k, v in books["device_memory_at_peak"].items()
            if k in ("activations", "activation_checkpoints"))
        per_process.append({"rank": rank, "measured": measured, "plan": plan_rows[rank],
                            "books": books})
    total = {k: sum(p["measured"][k] or 0 for p in per_process)
             for k in per_process[0]["measured"]}
    total["shm_parameters"] = first["shm_bytes"]  # the job's files, each byte once
    plan_total = {k: None if plan_rows[0][k] is None else sum(r[k] for r in plan_rows)
                  for k in plan_rows[0]}
    plan_total["shm_parameters"] = plan_shm
    host_tier = total["shm_parameters"] + sum(total[k] for k in HOST_TIER)
    plan_host_tier = plan_shm + sum(plan_total[k] for k in HOST_TIER)
    return {
        "benchmark": "host memory by category: the kernel's view against the plan",
        "date": time.strftime("%Y-%m-%d"), "machine": machine(load=os.getloadavg()),
        "nproc": nproc, "flags": flags, "parameters": params,
        "total": {"measured": total, "plan": plan_total,
                  "plan_over_measured": {k: ratio(plan_total[k], total.get(k))
                                         for k in plan_total}},
        "host_tier_bytes_per_param": {"measured": host_tier / params,
                                      "plan": plan_host_tier / params},
        "per_process": per_process,
        "launches": {name: phases_of(launch) for name, launch in launches.items()},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--load", choices=("same", "resharded", "none"), default="same",
                   help="start a second run from the first's checkpoint: on the same shape, "
                        "or resharded (1F1B, a forward stage per process)")
    p.add_argument("--out", help="keep the runs' files here (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(own)
    if args.worker:
        return worker(args.worker, flags)
    if args.nproc < 1 or args.iterations < 2:
        p.error("--nproc: expected >= 1; --iterations: expected >= 2 (a steady state)")
    scratch = args.out or tempfile.mkdtemp(prefix="bench-host-memory-")
    ckpt = os.path.join(scratch, "checkpoint")
    flags = with_defaults(SHAPE_054B, flags)
    first_flags = [*flags, "--train-iters", str(args.iterations), "--save", ckpt]
    try:
        launches = {"first": launch(args.nproc, first_flags, os.path.join(scratch, "first"))}
        if args.load != "none":
            # resharded: other stages, owned otherwise (the last value of a flag wins)
            shape = (["--pipeline-schedule", "1f1b", "--forward-stages", str(args.nproc),
                      "--backward-split", "1"] if args.load == "resharded" else [])
            launches[f"load ({args.load})"] = launch(
                args.nproc, [*flags, *shape, "--train-iters", str(2 * args.iterations),
                             "--load", ckpt], os.path.join(scratch, "load"))
        result = report(launches, first_flags, args.nproc)
    finally:
        if not args.out:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
