"""Every schedule on real processes (torchrun, gloo) against one-process training.

The same model, data and initial weights: per-iteration losses and the final fp32 master
parameters must agree (relative error < 1e-5), an injected overflow must skip the same
iteration everywhere, and a failing rank must bring the job down with /dev/shm clean.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.config.errors import ConfigError
from megatron.data.run_data import prepare_data
from megatron.data.sampling import evaluation_micro_batches
from megatron.models.llama import LlamaConfig, LlamaModel, gpt_model_name
from megatron.offload.device import CHAOS_ENV
from megatron.offload.param_store import job_segments
from megatron.pipeline.replicas import LINK_DELAY_ENV
from megatron.planning.shape import check_pipeline_shape, generate_schedule
from megatron.schedules.cost_model import backward_stage_params, calibrated_costs
from megatron.schedules.grid import LEGEND, cell
from megatron.schedules.instructions import Op
from megatron.schedules.simulator import simulate
from megatron.schedules.timeline import read_chrome_trace
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import MASTER
from megatron.training.checkpointing import read_all_tensors
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import main
from tests import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0", "--log-interval", "1",
         "--p2p-check",  # every transfer checked: the tensor that arrives is the one expected
         "--eval-interval", "5", "--eval-iters", "2", "--split", "90,8,2"]
SCHEDULES = ["decoupled", "mobius", "interleaved-1f1b", "1f1b", "gpipe"]
# What a feature below the schedule (where and in what precision the optimizer states live,
# device subgroups) is checked on: the schedule whose CPU steps overlap the next iteration
# speculatively (decoupled) and one stepping several stages per rank after the flush
# (interleaved-1f1b). Every schedule's training is checked against one process here.
FEATURE_SCHEDULES = ["decoupled", "interleaved-1f1b"]
TWO_NODE_SCHEDULES = ["decoupled", "mobius", "interleaved-1f1b"]
SLOW_LINK_S = 0.1  # the simulated inter-node link's delay per push (two-node runs)


class Launch:
    """A run started with `start`: `wait()` gives what subprocess.run would, plus `out`
    (its outputs), `ranks`, `extra` (its flags) and `elapsed`."""

    def __init__(self, job, out, nproc, extra, timeout):
        self.job, self.out, self.nproc, self.extra, self.timeout = job, out, nproc, extra, timeout
        self.t0 = time.monotonic()

    def wait(self):
        proc = self.job.wait(self.timeout)
        proc.elapsed = time.monotonic() - self.t0
        proc.out, proc.ranks, proc.extra = self.out, self.nproc, self.extra
        return proc


def _arguments(out, extra, script):
    args = [*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"], *extra]
    if script == "pretrain_llama.py":
        args += ["--metrics-file", str(out / "metrics.jsonl"), "--save", str(out / "ckpt"),
                 "--tensorboard-dir", str(out / "tb"), "--log-timers-to-tensorboard"]
    else:
        args += ["--out-dir", str(out)]
        if "--schedules" not in extra:
            args += ["--schedules", ",".join(SCHEDULES)]
    return args


def start(tmp_path, name, nproc, *extra, env=None, timeout=300, script="pretrain_llama.py"):
    """Start `script` (one process, or `nproc` ranks with torchrun's environment) on the
    test model; its outputs (metrics, checkpoints) go to tmp_path/name. The ranks are forks
    of the test session's preloaded zygote (tests/forked_ranks.py). Runs started together
    share the cores: one run's bubbles are another's compute."""
    out = tmp_path / name
    out.mkdir()
    job = forked_ranks.start(script, _arguments(out, extra, script), nproc,
                             env={"OMP_NUM_THREADS": "1", **(env or {})})
    return Launch(job, out, nproc, extra, timeout)


def launch(tmp_path, name, nproc, *extra, env=None, timeout=300, script="pretrain_llama.py",
           real_torchrun=False):
    """start(...).wait(); `real_torchrun` starts torchrun itself instead, for what only its
    behaviour shows."""
    if not real_torchrun:
        return start(tmp_path, name, nproc, *extra, env=env, timeout=timeout,
                     script=script).wait()
    out = tmp_path / name
    out.mkdir()
    # --standalone with the run id the test names (its job's shared-memory segments)
    run_id = (env or {}).get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
    cmd = [TORCHRUN, "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           "localhost:0", "--rdzv-id", run_id, "--nproc-per-node", str(nproc),
           os.path.join(ROOT, script), *_arguments(out, extra, script)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    proc.elapsed = time.monotonic() - t0
    proc.out, proc.ranks, proc.extra = out, nproc, extra
    return proc


class ScheduleRun:
    """One schedule's outputs inside a tests/run_schedules.py run."""

    def __init__(self, run, schedule):
        self.returncode, self.stderr = run.returncode, run.stderr
        self.out = run.out / schedule
        self.ranks, self.extra = run.ranks, run.extra


def refused_in_process(capsys, tmp_path, name, *extra):
    """pretrain_llama.py's main() in this process, for a run that must be refused before
    anything starts: what subprocess.run would give (returncode, stderr) and `out`."""
    out = tmp_path / name
    out.mkdir()
    try:
        code = main(_arguments(out, extra, "pretrain_llama.py"))
    except SystemExit as exc:
        code = exc.code
    proc = subprocess.CompletedProcess(["pretrain_llama.py"], code, *capsys.readouterr())
    proc.out = out
    return proc


def start_all_schedules(tmp_path_factory, nproc, *extra, env=None):
    return start(tmp_path_factory.mktemp(f"schedules{nproc}"), "all", nproc, *extra,
                 script="tests/run_schedules.py", timeout=600, env=env)


def succeeded(run):
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def metrics(run, evaluations=False):
    """The iteration lines of the run's metrics file (or its evaluation lines)."""
    with open(run.out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [row for row in rows if ("evaluation" in row) == evaluations]


def final_masters(run):
    return read_all_tensors(str(run.out / "ckpt" / "iter_0000005"), prefix="model.")


def assert_same_training(run, reference, rel=1e-5):
    assert run.returncode == 0, run.stderr[-4000:]
    ours, ref = metrics(run), metrics(reference)
    assert [m["iteration"] for m in ours] == [1, 2, 3, 4, 5]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel), (a["iteration"], a["loss"], b["loss"])
        assert a["skipped"] == b["skipped"]
    got, want = final_masters(run), final_masters(reference)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        error = (got[name] - tensor).norm() / tensor.norm()
        assert error < rel, (name, float(error))


@pytest.fixture(scope="module")
def started(request, tmp_path_factory, demo_cache):
    """The module's long runs that the selected tests need, started together."""
    needed = {name for item in request.session.items if item.module is request.module
              for name in item.fixturenames}
    runs = {}
    if "reference" in needed:
        runs["reference"] = start(tmp_path_factory.mktemp("ref"), "single", 1)
    if "unfused_reference" in needed:
        # attention as megatron-core's local spec computes it (the seq x seq scores), where
        # every other run here uses torch's scaled_dot_product_attention (the default)
        runs["unfused_reference"] = start(tmp_path_factory.mktemp("unfused"), "single", 1,
                                          "--attention-backend", "unfused")
    if "two_processes" in needed:
        # 4 micro-batches on 2 processes; decoupled: 4 forward stages split d = 2 (the default)
        # under chaos (copy streams delayed at random) and the sanitizer: a missing wait
        # changes the numbers or fails the run (docs/device-sanitizer.md)
        runs["two_processes"] = start_all_schedules(tmp_path_factory, 2,
                                                    env={CHAOS_ENV: "1"})
    if "four_processes" in needed:
        # Two simulated nodes of 2 processes: stages whose owner is on the other node are read
        # from replicas that the owner pushes, stage by stage, as it publishes them; each push
        # is held back by a simulated slow link, so they visibly overlap the next iteration.
        # Decoupled reads stages owned on the other node; Mobius' and the interleaved
        # mapping of 4 stages differ most from their 2-rank programs (1F1B and GPipe on 4
        # ranks are the 2-rank case with more stages).
        runs["four_processes"] = start_all_schedules(
            tmp_path_factory, 4, "--forward-stages", "4", "--backward-split", "2",
            "--procs-per-node", "2", "--schedules", ",".join(TWO_NODE_SCHEDULES),
            env={LINK_DELAY_ENV: str(SLOW_LINK_S)})
    return runs


@pytest.fixture(scope="module")
def reference(started):
    return succeeded(started["reference"].wait())


@pytest.fixture(scope="module")
def unfused_reference(started):
    return succeeded(started["unfused_reference"].wait())


@pytest.fixture(scope="module")
def two_processes(started):
    return succeeded(started["two_processes"].wait())


@pytest.fixture(scope="module")
def four_processes(started):
    return succeeded(started["four_processes"].wait())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_match_one_process(schedule, two_processes, reference):
    assert_same_training(ScheduleRun(two_processes, schedule), reference)
    assert metrics(ScheduleRun(two_processes, schedule))[0]["schedule"] == schedule


def test_unfused_attention_trains_as_the_pinned_math_kernel(unfused_reference, reference):
    """fp32 with grouped-query attention has one kernel on a GPU, math (the CPU device layer
    plays an A100 here; megatron.config.attention_kernel), and math computes what
    megatron-core's unfused attention (--attention-backend unfused) computes, operation for
    operation: the same bits. (A fused kernel computes otherwise within 1e-5:
    tests/test_attention.py, tests/test_attention_kernel.py.)"""
    sdpa, unfused = final_masters(reference), final_masters(unfused_reference)
    assert sdpa.keys() == unfused.keys()
    assert all(torch.equal(sdpa[name], unfused[name]) for name in sdpa)
    assert [m["loss"] for m in metrics(unfused_reference)] == \
        [m["loss"] for m in metrics(reference)]


def test_the_metrics_name_the_attention_kernel_that_ran(reference, unfused_reference,
                                                       two_processes):
    """fp32 with grouped-query attention: math, as on every GPU (the CPU device layer plays
    one, megatron.config.attention_kernel); megatron-core's own with --attention-backend
    unfused."""
    assert {m["attention_kernel"] for m in metrics(reference)} == {"math"}
    assert {m["attention_kernel"] for m in metrics(unfused_reference)} == {"unfused"}
    for schedule in SCHEDULES:
        assert {m["attention_kernel"] for m in metrics(ScheduleRun(two_processes, schedule))} \
            == {"math"}, schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_with_sdpa_matches_one_process_with_unfused_attention(
        schedule, two_processes, unfused_reference):
    """The attention kernel changes nothing a user sees: each schedule's run (SDPA, the
    default, pinned) trains like one process computing attention unfused, within 1e-5."""
    assert_same_training(ScheduleRun(two_processes, schedule), unfused_reference)


@pytest.mark.parametrize("schedule", TWO_NODE_SCHEDULES)
def test_four_processes_match_one_process(schedule, four_processes, reference):
    assert_same_training(ScheduleRun(four_processes, schedule), reference)


def test_parameters_reach_the_other_node_per_stage_while_the_next_iteration_runs(
        four_processes):
    """The last iteration's measured timeline of the two-node decoupled run: on the node
    that reads a stage owned on the other node, a forward of that stage starts only once
    its new version has arrived, yet before the last push of the step has finished (a
    blocking distribution after the whole step would finish every push first)."""
    events = read_chrome_trace(str(ScheduleRun(four_processes, "decoupled").out
                                   / "trace.json"))
    pushes = [e for e in events if e.kind == "distribution"]
    receipts = [e for e in pushes if e.label.startswith("r")]
    assert receipts and any(e.label.startswith("d") for e in pushes)
    forwards = [e for e in events if e.kind == "forward"]
    for receipt in receipts:
        stage_forwards = [f for f in forwards
                             if f.rank == receipt.rank and f.stage == receipt.stage]
        assert stage_forwards, receipt
        assert min(f.start for f in stage_forwards) >= receipt.end, receipt
    last_push_end = max(e.end for e in pushes)
    first_forward = min(f.start for f in forwards)
    assert first_forward < last_push_end - SLOW_LINK_S / 2, (first_forward, last_push_end)


def test_the_measured_iteration_calibrates_the_simulation_of_each_schedule(
        two_processes, four_processes):
    """The trace of the last iteration gives every stage's compute time, so the simulator
    can be put beside each measured run."""
    for run, schedules in ((two_processes, SCHEDULES), (four_processes, TWO_NODE_SCHEDULES)):
        for name in schedules:
            one = ScheduleRun(run, name)
            config = parse_args(args_for_schedule_argv(name, *one.extra))
            schedule = generate_schedule(config, one.ranks, vocab_size=_vocab(one))
            events = read_chrome_trace(str(one.out / "trace.json"))
            assert {e.rank for e in events} == set(range(one.ranks))
            model = replace(config.model, vocab_size=_vocab(one))
            params = backward_stage_params(model, schedule.partition, schedule.backward_split)
            sim = simulate(schedule, calibrated_costs(schedule, events, params, 4, 1e-9, 1e-10))
            assert sim.iteration_time > 0
            assert 0 <= sim.mean_bubble_ratio < 1
            assert metrics(one)[-1]["bubble_ratio"] < 1
            measured_split = 1 + max(e.sub for e in events if e.kind == "backward")
            assert measured_split == schedule.backward_split == (2 if name == "decoupled" else 1)


def args_for_schedule_argv(name, *extra):
    if "--schedules" in extra:  # tests/run_schedules.py's own flag
        at = extra.index("--schedules")
        extra = extra[:at] + extra[at + 2:]
    argv = [*MODEL, *extra, "--pipeline-schedule", name]
    if name != "decoupled":  # the baselines are coupled: their own default split
        argv = [a for i, a in enumerate(argv)
                if a != "--backward-split" and (i == 0 or argv[i - 1] != "--backward-split")]
    return argv


def _vocab(run):
    embedding = next(t for name, t in final_masters(run).items() if "word_embeddings" in name)
    return embedding.shape[0]


def test_fp16_overflow_skips_the_iteration_on_every_rank(reference, tmp_path):
    fp16 = ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1",
            "--inject-overflow", "3,1,0"]  # hysteresis 1: the first overflow halves the scale
    one = start(tmp_path, "fp16-single", 1, *fp16)
    two = start(tmp_path, "fp16-pipeline", 2, "--pipeline-schedule", "decoupled", *fp16)
    ref, run = one.wait(), two.wait()
    assert ref.returncode == 0, ref.stderr[-3000:]
    # 16-bit working copies: one rounding step of an fp32 master that differs in its last
    # bits (C++ AdamW vs torch's) moves a parameter by ~5e-4 relative, so 1e-3 here.
    assert_same_training(run, ref, rel=1e-3)
    rows = metrics(run)
    assert [m["skipped"] for m in rows] == [False, False, True, False, False]
    # the scale after each update, as Megatron logs it: halved by iteration 3's overflow
    assert [m["loss_scale"] for m in rows] == [1024, 1024, 512, 512, 512]


def test_decoupled_steps_while_its_rank_computes_and_mobius_after(tmp_path, reference):
    # A wide model on few tokens, so that the CPU optimizer is a large part of an iteration;
    # both schedules in the same run, from the measured breakdown of each.
    heavy = ["--hidden-size", "256", "--ffn-hidden-size", "688", "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6",
             "--cpu-optimizer-threads", "1", "--schedules", "decoupled,mobius"]
    run = launch(tmp_path, "heavy", 2, *heavy, script="tests/run_schedules.py")
    assert run.returncode == 0, run.stderr[-3000:]
    for schedule in ("decoupled", "mobius"):
        rows = metrics(ScheduleRun(run, schedule))[1:]  # the first iteration warms up
        for r in rows:
            assert r["gpu_time_s"] > 0 and r["bubble_time_s"] >= 0
            assert r["exposed_optimizer_time_s"] > 0
            assert [p["rank"] for p in r["per_rank"]] == [0, 1]
    # Why the decoupled schedule exposes less of the optimizer is in its programs: a rank
    # starts a stage's step while it still has backwards to run, where Mobius starts every
    # step after its last. The measured times are compared by bench/schedules.py (rounds),
    # not here: in a loaded CI run the two read 0.0285 and 0.0282 s.
    vocab = _vocab(reference)
    for schedule, overlaps in (("decoupled", True), ("mobius", False)):
        shape = generate_schedule(parse_args(args_for_schedule_argv(schedule, *heavy)), 2, vocab)
        for program in shape.programs:
            last_compute = max(i for i, instr in enumerate(program)
                               if instr.op in (Op.FORWARD, Op.BACKWARD))
            early = [instr for instr in program[:last_compute]
                     if instr.op in (Op.OPTIMIZER_START, Op.OPTIMIZER_START_SUBGROUPS)]
            assert bool(early) == overlaps, (schedule, early)


def test_waiting_at_the_verdict_for_the_other_rank_is_reported_as_bubble(two_processes):
    # Every schedule ends with the verdict's all-reduce; the rank that joins it last waits
    # only for the reduction, the other's wait beyond that is its bubble, not its optimizer.
    for schedule in SCHEDULES:
        for row in metrics(ScheduleRun(two_processes, schedule)):
            ranks = row["per_rank"]
            assert min(r["verdict_peer_wait_s"] for r in ranks) == 0.0, (schedule, ranks)
            for r in ranks:
                assert 0.0 <= r["verdict_peer_wait_s"] <= r["verdict_wait_s"]
                # the reduction itself stays exposed
                assert r["exposed_optimizer_time_s"] >= (
                    r["verdict_wait_s"] - r["verdict_peer_wait_s"] - 1e-9)
                assert r["bubble_time_s"] >= r["verdict_peer_wait_s"] - 1e-9


def _own_job() -> tuple[dict, list]:
    """A run id for a job the test starts, and the names of that job's segments in /dev/shm
    (a callable): the tests running beside this one have segments of their own."""
    run_id = f"test-{uuid.uuid4().hex}"
    return {"TORCHELASTIC_RUN_ID": run_id}, lambda: job_segments(f"run:{run_id}")


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_job_and_leaves_shm_clean(how, reference, tmp_path):
    """A rank that raises, or is killed under torchrun (the killed run keeps its optimizer
    states on NVMe): the job ends, and neither a shared-memory segment nor a state file
    outlives it."""
    job, segments = _own_job()
    drive = tmp_path / "drive"
    drive.mkdir()
    on_disk = ["--optimizer-state-location", "nvme", "--optimizer-nvme-path", str(drive)]
    run = launch(tmp_path, f"fail-{how}", 2, "--pipeline-schedule", "decoupled",
                 *(on_disk if how == "kill" else []),
                 env={"MEGATRON_SYSX_TEST_FAIL": f"1,2,3,{how}", **job}, timeout=120,
                 real_torchrun=how == "kill")  # what torchrun does about a killed worker
    assert run.returncode != 0
    assert run.elapsed < 120
    if how == "raise":
        assert "rank 1: instruction 3" in run.stderr and "iteration 2" in run.stderr
        # the failing rank prints the programs as a schedule file's error does, with the
        # failing instruction marked
        config = parse_args([*MODEL, "--pipeline-schedule", "decoupled"])
        program = generate_schedule(config, 2, vocab_size=_vocab(reference)).programs[1]
        assert f"[{cell(program[3])}]" in run.stderr
        assert re.search(r"rank +0 +1 +2 ", run.stderr)  # the header: instruction indices
        assert LEGEND in run.stderr
    else:
        assert "rank" in run.stderr and "-9" in run.stderr or "SIGKILL" in run.stderr
    deadline = time.monotonic() + 10  # the reapers run when their processes are gone
    while (segments() or os.listdir(drive)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not segments()
    assert os.listdir(drive) == []


@pytest.mark.parametrize(
    "extra,flag",
    [(["--forward-stages", "9"], "--forward-stages"),
     (["--stage-layers", "3,3,3,3"], "--stage-layers"),
     (["--forward-stages", "4", "--backward-split", "3"], "--backward-split"),
     (["--forward-stages", "3"], "--forward-stages")],
)
def test_bad_pipeline_flags_are_refused_before_anything_is_built(extra, flag, capsys):
    run = parse_args([*MODEL, "--pipeline-schedule", "decoupled", *extra])
    with pytest.raises(ConfigError) as exc:
        check_pipeline_shape(run, world_size=2)
        generate_schedule(run, world_size=2, vocab_size=4096)
    assert exc.value.flag == flag


@pytest.mark.parametrize("processes,flag", [(2, 4), (1, 2)])
def test_world_size_mismatch_exits_2_naming_the_flag(demo_cache, tmp_path, processes, flag,
                                                      capsys):
    # one process included: a launch without torchrun must not train the whole model
    bad = ("--pipeline-model-parallel-size", str(flag))
    run = (launch(tmp_path, "bad", processes, *bad, timeout=120) if processes > 1
           else refused_in_process(capsys, tmp_path, "bad", *bad))
    assert run.returncode == 2 if processes == 1 else run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "pretrain_llama.py: error" in line]
    assert len(lines) == 1 and f"--pipeline-model-parallel-size {flag}" in lines[0]
    assert not (run.out / "metrics.jsonl").exists()


def test_replica_plan_covers_every_remote_reader():
    from megatron.schedules.generators import build_schedule
    from megatron.schedules.replica_plan import node_of, plan_replicas

    schedule = build_schedule("decoupled", 4, 4, 2, 4, partition=(2, 2, 2, 2))
    plan = {r.backward_stage: r for r in plan_replicas(schedule, procs_per_node=2)}
    assert plan  # the four-process run above really reads stages across nodes
    for rank, program in enumerate(schedule.programs):
        for instr in program:
            if instr.op != Op.PREFETCH_PARAMS:
                continue
            for b in schedule.params_of(instr.stage, instr.sub):
                owner = schedule.backward_rank[b]
                if node_of(rank, 2) != node_of(owner, 2):
                    holders = plan[b].holders
                    assert [h for h in holders if node_of(h, 2) == node_of(rank, 2)]
    assert plan_replicas(schedule, procs_per_node=4) == []  # one node: nothing to push


def _write_schedule_file(path, ranks, *extra):
    tool = os.path.join(ROOT, "tools", "simulate_pipeline.py")
    run = subprocess.run([sys.executable, tool, "--schedule", "decoupled", "--ranks", str(ranks),
                          "--forward-stages", "4", "--backward-split", "2", "--micro-batches",
                          "4", "--partition", "2,2,2,2", "--schedule-file", str(path), *extra],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return path.read_text().splitlines(keepends=True)


def _legal_swap(lines):
    """The CSV with the first pair of adjacent instructions of rank 0 swapped such that the
    schedule stays valid (an edit a user could make by hand)."""
    from megatron.schedules.schedule_file import schedule_from_csv
    from megatron.schedules.validator import validate

    rows = [i for i, line in enumerate(lines) if line.startswith("0,")]
    for a, b in zip(rows, rows[1:]):
        edited = list(lines)
        edited[a], edited[b] = edited[b], edited[a]
        if edited[a] == edited[b]:
            continue
        try:
            validate(schedule_from_csv("".join(edited)))
        except ValueError:
            continue
        return edited
    raise AssertionError("no legal swap of two adjacent instructions on rank 0")


def test_schedule_files_train_like_the_generated_schedule(reference, tmp_path):
    generated = tmp_path / "decoupled.csv"
    lines = _write_schedule_file(generated, 2)
    edited = tmp_path / "edited.csv"
    edited.write_text("".join(_legal_swap(lines)))
    # The file as written reads back to the generated programs (test_simulate_cli); one
    # launch of a hand-edited legal variant shows that a file's programs are what runs.
    assert edited.read_text() != generated.read_text()
    run = launch(tmp_path, edited.stem, 2, "--schedule-file", str(edited))
    assert_same_training(run, reference)


def test_a_broken_schedule_file_exits_2_naming_rank_index_and_rule(demo_cache, tmp_path,
                                                                    capsys, monkeypatch):
    path = tmp_path / "broken.csv"
    lines = _write_schedule_file(path, 1)
    first_backward = next(i for i, line in enumerate(lines) if ",BACKWARD," in line)
    del lines[first_backward]  # one backward never runs: its gradient is missing downstream
    path.write_text("".join(lines))
    job, segments = _own_job()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job["TORCHELASTIC_RUN_ID"])
    run = refused_in_process(capsys, tmp_path, "broken", "--schedule-file", str(path))
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if "pretrain_llama.py: error" in line]
    assert len(errors) == 1
    assert "--schedule-file" in errors[0] and "rank 0, instruction #" in errors[0]
    assert "rule '" in errors[0]
    grid = run.stderr.splitlines()
    assert any(line.startswith("rank ") for line in grid)  # the programs, one row per rank,
    assert "[OG3.1]" in run.stderr  # with the offending instruction marked
    assert not (run.out / "metrics.jsonl").exists() and not (run.out / "ckpt").exists()
    assert not segments()


def test_a_schedule_file_for_another_run_exits_2(demo_cache, tmp_path, capsys):
    path = tmp_path / "two-ranks.csv"
    _write_schedule_file(path, 2)
    run = refused_in_process(capsys, tmp_path, "mismatch", "--schedule-file", str(path))
    assert run.returncode == 2
    assert "the file has ranks=2, this run has 1" in run.stderr


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_host_to_device_parameter_bytes_are_what_each_program_prefetches(schedule,
                                                                         two_processes):
    """Every iteration, each rank copies into its slots the fp32 parameters of every
    backward stage a PREFETCH_PARAMS of its program makes resident (a stage still resident
    is not copied again): the metric reports that per rank and summed over the pipeline."""
    one = ScheduleRun(two_processes, schedule)
    config = parse_args(args_for_schedule_argv(schedule, *one.extra))
    shape = generate_schedule(config, one.ranks, vocab_size=_vocab(one))
    params = backward_stage_params(replace(config.model, vocab_size=_vocab(one)),
                                   shape.partition, shape.backward_split)
    expected = []
    for program in shape.programs:
        resident, copied = set(), 0
        for instr in program:
            stages = shape.params_of(instr.stage, instr.sub)
            if instr.op == Op.PREFETCH_PARAMS:
                copied += sum(4 * params[b] for b in stages if b not in resident)
                resident.update(stages)
            elif instr.op == Op.RELEASE_PARAMS:
                resident.difference_update(stages)
        expected.append(copied)
    for row in metrics(one):
        assert [r["h2d_parameter_bytes"] for r in row["per_rank"]] == expected
        assert row["h2d_parameter_bytes"] == sum(expected)


def test_host_syncs_per_iteration_do_not_grow_with_micro_batches(two_processes, tmp_path):
    """On a GPU every read of a device value and every wait for the device stalls the
    pipeline: the loss is read once per iteration, not per micro-batch."""
    four = metrics(ScheduleRun(two_processes, "decoupled"))  # 4 micro-batches
    run = launch(tmp_path, "eight", 2, "--pipeline-schedule", "decoupled",
                 "--global-batch-size", "16",  # 8 micro-batches
                 "--train-iters", "2", "--eval-iters", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    eight = metrics(run)
    for rows in (four, eight):
        for row in rows:
            # the end-of-iteration wait for the compute stream, and the loss on its rank
            assert row["host_syncs"] == 2
            assert [r["host_syncs"] for r in row["per_rank"]] == [1, 2]


def test_device_memory_does_not_grow_with_the_backward_stages_a_rank_owns(tmp_path,
                                                                          two_processes):
    """Doubling the layers at two layers per stage doubles the stages every rank runs and
    owns; the device peak may grow only by the extra activation checkpoints (gradient
    buffers are lent per running backward stage, parameters live in a fixed set of slots)."""
    seq, micro_batch, hidden, d, micro_batches, ranks = 32, 2, 64, 2, 4, 2
    # 8 layers: the two-process decoupled run (4 stages of 2 layers, d = 2) is that shape
    eight = ScheduleRun(two_processes, "decoupled")
    run = parse_args(args_for_schedule_argv("decoupled", *eight.extra))
    shape = generate_schedule(run, ranks, vocab_size=_vocab(eight))
    assert (shape.partition, shape.backward_split) == ((2, 2, 2, 2), d)
    peaks = {8: metrics(eight)[-1]["per_rank"]}
    stages = 16 // 2
    run = launch(tmp_path, "layers16", ranks, "--num-layers", "16",
                 "--forward-stages", str(stages), "--backward-split", str(d),
                 "--stage-layers", ",".join(["2"] * stages), "--train-iters", "2",
                 "--pipeline-schedule", "decoupled")
    assert run.returncode == 0, run.stderr[-3000:]
    peaks[16] = metrics(run)[-1]["per_rank"]
    ckpt_bytes = seq * micro_batch * hidden * 4  # one fp32 activation checkpoint
    # Per rank and iteration: d checkpoints per micro-batch of every forward stage it runs,
    # one per micro-batch of every backward stage it owns (received or kept).
    extra_forward_stages, extra_owned = (16 - 8) // 2 // ranks, (16 - 8) // 2 * d // ranks
    bound = (extra_forward_stages * d + extra_owned) * micro_batches * ckpt_bytes
    for small, large in zip(peaks[8], peaks[16]):
        growth = large["device_memory_peak_bytes"] - small["device_memory_peak_bytes"]
        assert 0 < growth <= bound, (growth, bound)
        for fixed in ("parameter_slots", "gradient_buffers", "activations"):
            assert large["device_memory_at_peak"][fixed] == small["device_memory_at_peak"][fixed]


@pytest.fixture(scope="module")
def forward_only_reference(reference):
    """Independent of the pipeline: the whole model in this process, loaded with a run's
    final weights, forward only over the samples of an end-of-training evaluation."""
    run = parse_args([*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"]])
    initialize_distributed()  # one process: megatron-core's model and dataset builder need it
    data = prepare_data(run, log=lambda *_: None)
    model = LlamaModel(LlamaConfig.from_model(run.model, data.vocab_size, run.training.seed))
    datasets = data.datasets
    samples = {"validation": evaluation_micro_batches(datasets.valid, run.evaluations - 1, run),
               "test": evaluation_micro_batches(datasets.test, 0, run)}

    # checkpoints hold GPTModel names; the reference model is the chain of pieces
    piece_names = {MASTER + gpt_model_name(model.cfg, index, name): f"pieces.{index}.{name}"
                   for index, piece in enumerate(model.pieces)
                   for name, _ in piece.named_parameters()}

    def evaluate(run, split):
        masters = final_masters(run)
        assert masters.keys() == piece_names.keys()
        model.load_state_dict({piece_names[k]: v for k, v in masters.items()}, strict=False)
        with torch.no_grad():
            losses = [float(model(b)) for mbs in samples[split] for b in mbs]
        return sum(losses) / len(losses)

    yield evaluate
    shutdown_distributed()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_validation_loss_is_a_forward_only_evaluation_of_the_final_weights(
        schedule, two_processes, forward_only_reference):
    run = ScheduleRun(two_processes, schedule)
    evals = metrics(run, evaluations=True)
    # --eval-interval 5 over 5 iterations: at iteration 5, then at the end (validation, test).
    assert [(e["iteration"], e["evaluation"], e["end_of_training"]) for e in evals] == [
        (5, "validation", False), (5, "validation", True), (5, "test", True)]
    for record in evals[1:]:
        expected = forward_only_reference(run, record["evaluation"])
        assert record["lm_loss"] == pytest.approx(expected, rel=1e-5), record
        assert record["lm_loss_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert evals[0]["lm_loss"] != evals[1]["lm_loss"]  # the next evaluation reads new batches


def test_logs_and_tensorboard_carry_megatrons_names(reference, two_processes):
    assert " validation loss at iteration 5 | lm loss value: " in reference.stdout
    assert " validation loss at iteration 5 on validation set | " in reference.stdout
    assert " validation loss at iteration 5 on test set | " in reference.stdout
    assert "setup: data done in" in reference.stdout and "eta: " in reference.stdout
    for out, pipeline in ((reference.out, False), (ScheduleRun(two_processes, "decoupled").out, True)):
        events = EventAccumulator(str(out / "tb"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        for tag in ("lm loss", "learning-rate", "grad-norm", "iteration-time", "batch-size",
                    "tokens-per-second"):
            assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4, 5], tag
        assert [e.step for e in events.Scalars("lm loss validation")] == [5, 5]
        assert [e.step for e in events.Scalars("lm loss test")] == [5]
        breakdown = {"pipeline/bubble-time", "pipeline/exposed-optimizer-time",
                     "pipeline/device-memory-peak-bytes"}
        assert (breakdown <= tags) == pipeline


def test_sigterm_saves_the_last_iteration_and_the_resumed_run_continues(tmp_path, two_processes):
    """SIGTERM to both training processes of a running job: each finishes its iteration,
    they agree, save, and exit 0 together; the resumed run gives the uninterrupted losses."""
    job, segments = _own_job()
    out = tmp_path / "stopped"
    out.mkdir()
    flags = [*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"],
             "--pipeline-schedule", "decoupled", "--exit-signal-handler",
             "--save", str(out / "ckpt")]
    job = forked_ranks.start("pretrain_llama.py",
                             [*flags, "--metrics-file", str(out / "metrics.jsonl")], 2,
                             env=job)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert job.running() and time.monotonic() < deadline, job.wait().stderr[-3000:]
            time.sleep(0.02)
        assert len(job.pids) == 2
        for pid in job.pids:
            os.kill(pid, signal.SIGTERM)
    finally:
        proc = job.wait(timeout=240)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stderr[-3000:]
    assert not segments()  # every segment released on the way out
    done = [row["iteration"] for row in metrics(SimpleNamespace(out=out))]
    assert 1 <= done[-1] < 5 and "SIGTERM received" in stdout
    tracker = out / "ckpt" / "latest_checkpointed_iteration.txt"
    assert int(tracker.read_text()) == done[-1]

    resumed = launch(tmp_path, "resumed", 2, "--pipeline-schedule", "decoupled",
                     "--load", str(out / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rest = metrics(resumed)
    assert [row["iteration"] for row in rest] == list(range(done[-1] + 1, 6))
    uninterrupted = {row["iteration"]: row["loss"]
                     for row in metrics(ScheduleRun(two_processes, "decoupled"))}
    for row in rest:
        assert row["loss"] == pytest.approx(uninterrupted[row["iteration"]], rel=1e-6)
