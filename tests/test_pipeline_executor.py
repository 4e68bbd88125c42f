"""Every schedule on real processes (torchrun, gloo) against one-process training.

The same model, data and initial weights: per-iteration losses and the final fp32 master
parameters must agree (relative error < 1e-5), an injected overflow must skip the same
iteration everywhere, and a failing rank must bring the job down with /dev/shm clean.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0", "--log-interval", "1"]
SCHEDULES = ["decoupled", "mobius", "interleaved-1f1b", "1f1b", "gpipe"]


def launch(tmp_path, name, nproc, *extra, env=None, timeout=300, script="pretrain_llama.py"):
    """Run `script` (one process, or torchrun with `nproc`) on the test model; its outputs
    (metrics, checkpoints) go to tmp_path/name."""
    out = tmp_path / name
    out.mkdir()
    args = [*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"], *extra]
    if script == "pretrain_llama.py":
        args += ["--metrics-file", str(out / "metrics.jsonl"), "--save", str(out / "ckpt")]
    else:
        args += ["--out-dir", str(out), "--save-final", "--json"]
    path = os.path.join(ROOT, script)
    if nproc == 1:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), path, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)
    proc.elapsed = time.monotonic() - t0
    proc.out = out
    return proc


class ScheduleRun:
    """One schedule's outputs inside a bench/schedules.py run."""

    def __init__(self, bench, schedule):
        self.returncode, self.stderr = bench.returncode, bench.stderr
        self.out = bench.out / schedule


def bench_all_schedules(tmp_path_factory, nproc, *extra):
    run = launch(tmp_path_factory.mktemp(f"bench{nproc}"), "all", nproc, *extra,
                 script="bench/schedules.py", timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    run.summary = json.loads(run.stdout[run.stdout.index("{"):])
    return run


def metrics(run):
    with open(run.out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def final_masters(run):
    directory = run.out / "ckpt" / "iter_0000005"
    merged = {}
    for path in sorted(directory.glob("rank_*.pt")):
        state = torch.load(path, weights_only=False)["train_step"]["model"]
        assert not merged.keys() & state.keys(), "a parameter owned by two ranks"
        merged.update(state)
    return merged


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
def reference(tmp_path_factory):
    os.environ.setdefault("MEGATRON_TEST_CACHE", str(tmp_path_factory.mktemp("cache")))
    run = launch(tmp_path_factory.mktemp("ref"), "single", 1)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, reference):
    # 4 micro-batches on 2 processes; decoupled: 4 forward stages split d = 2 (the default).
    return bench_all_schedules(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory, reference):
    # Two simulated nodes of 2 processes: stages whose owner is on the other node are read
    # from replicas that the owner updates after every step.
    return bench_all_schedules(tmp_path_factory, 4, "--forward-stages", "4",
                               "--backward-split", "2", "--procs-per-node", "2")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_match_one_process(schedule, two_processes, reference):
    assert_same_training(ScheduleRun(two_processes, schedule), reference)
    assert metrics(ScheduleRun(two_processes, schedule))[0]["schedule"] == schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_four_processes_match_one_process(schedule, four_processes, reference):
    assert_same_training(ScheduleRun(four_processes, schedule), reference)


def test_bench_puts_the_simulation_beside_each_measurement(two_processes, four_processes):
    for run, ranks in ((two_processes, 2), (four_processes, 4)):
        rows = {r["schedule"]: r for r in run.summary["schedules"]}
        assert run.summary["ranks"] == ranks and set(rows) == set(SCHEDULES)
        assert rows["decoupled"]["backward_split"] == 2
        for row in rows.values():
            assert row["simulated_iteration_time_s"] > 0
            assert 0 <= row["bubble_ratio"] < 1 and 0 <= row["simulated_bubble_ratio"] < 1


def test_fp16_overflow_skips_the_iteration_on_every_rank(reference, tmp_path):
    fp16 = ["--fp16", "--initial-loss-scale", "1024", "--inject-overflow", "3,1,0"]
    ref = launch(tmp_path, "fp16-single", 1, *fp16)
    run = launch(tmp_path, "fp16-pipeline", 2, "--pipeline-schedule", "decoupled", *fp16)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # 16-bit working copies: one rounding step of an fp32 master that differs in its last
    # bits (C++ AdamW vs torch's) moves a parameter by ~5e-4 relative, so 1e-3 here.
    assert_same_training(run, ref, rel=1e-3)
    rows = metrics(run)
    assert [m["skipped"] for m in rows] == [False, False, True, False, False]
    assert [m["loss_scale"] for m in rows] == [1024, 1024, 1024, 512, 512]


def test_exposed_optimizer_time_is_lower_with_the_decoupled_schedule(tmp_path, reference):
    # A wide model on few tokens, so that the CPU optimizer is a large part of an iteration;
    # both schedules in the same run, from the measured breakdown of each.
    heavy = ["--hidden-size", "256", "--ffn-hidden-size", "688", "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6",
             "--cpu-optimizer-threads", "1", "--schedules", "decoupled,mobius"]
    run = launch(tmp_path, "heavy", 2, *heavy, script="bench/schedules.py")
    assert run.returncode == 0, run.stderr[-3000:]
    exposed = {}
    for schedule in ("decoupled", "mobius"):
        rows = metrics(ScheduleRun(run, schedule))[1:]  # the first iteration warms up
        exposed[schedule] = sum(r["exposed_optimizer_time_s"] for r in rows) / len(rows)
        for r in rows:
            assert r["gpu_time_s"] > 0 and r["bubble_time_s"] >= 0
            assert [p["rank"] for p in r["per_rank"]] == [0, 1]
    assert exposed["decoupled"] < exposed["mobius"], exposed


def _job_segments():
    return [name for name in os.listdir("/dev/shm") if name.startswith("mlm-")]


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_job_and_leaves_shm_clean(how, reference, tmp_path):
    before = set(_job_segments())
    run = launch(tmp_path, f"fail-{how}", 2, "--pipeline-schedule", "decoupled",
                 env={"MEGATRON_SYSX_TEST_FAIL": f"1,2,3,{how}"}, timeout=120)
    assert run.returncode != 0
    assert run.elapsed < 120
    if how == "raise":
        assert "rank 1: instruction 3" in run.stderr and "iteration 2" in run.stderr
    else:
        assert "rank" in run.stderr and "-9" in run.stderr or "SIGKILL" in run.stderr
    deadline = time.monotonic() + 10  # the reaper runs when its parent is gone
    while set(_job_segments()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_job_segments()) - before


@pytest.mark.parametrize(
    "extra,flag",
    [(["--forward-stages", "9"], "--forward-stages"),
     (["--stage-layers", "3,3,3,3"], "--stage-layers"),
     (["--forward-stages", "4", "--backward-split", "3"], "--backward-split"),
     (["--forward-stages", "3"], "--forward-stages")],
)
def test_bad_pipeline_flags_are_refused_before_anything_is_built(extra, flag, capsys):
    from megatron.pipeline.train_step import check_pipeline_args, resolve_pipeline
    from megatron.training.arguments import ArgumentError, parse_args

    args = parse_args([*MODEL, "--pipeline-schedule", "decoupled", *extra])
    with pytest.raises(ArgumentError) as exc:
        check_pipeline_args(args, world_size=2)
        resolve_pipeline(args, world_size=2, vocab_size=4096)
    assert exc.value.flag == flag


def test_world_size_mismatch_exits_2_naming_the_flag(reference, tmp_path):
    run = launch(tmp_path, "bad", 2, "--pipeline-model-parallel-size", "4", timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "pretrain_llama.py: error" in line]
    assert len(lines) == 1 and "--pipeline-model-parallel-size 4" in lines[0]
    assert not (run.out / "metrics.jsonl").exists()


def test_replica_plan_covers_every_remote_reader():
    from megatron.offload.naming import node_of
    from megatron.pipeline.replicas import plan_replicas
    from megatron.schedules.generators import build_schedule
    from megatron.schedules.instructions import Op

    schedule = build_schedule("decoupled", 4, 4, 2, 4, partition=(2, 2, 2, 2))
    plan = {r.piece: r for r in plan_replicas(schedule, procs_per_node=2)}
    assert plan  # the four-process run above really reads stages across nodes
    for rank, program in enumerate(schedule.programs):
        for instr in program:
            if instr.op != Op.PREFETCH_PARAMS:
                continue
            for piece in schedule.stage_pieces(instr.stage, instr.sub):
                owner = schedule.backward_rank[piece]
                if node_of(rank, 2) != node_of(owner, 2):
                    holders = plan[piece].holders
                    assert [h for h in holders if node_of(h, 2) == node_of(rank, 2)]
    assert plan_replicas(schedule, procs_per_node=4) == []  # one node: nothing to push
