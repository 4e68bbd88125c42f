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


def launch(tmp_path, name, nproc, *extra, env=None, timeout=240):
    """Run pretrain_llama.py (one process, or torchrun with `nproc`); return its outputs."""
    out = tmp_path / name
    out.mkdir()
    args = [*MODEL, "--metrics-file", str(out / "metrics.jsonl"), "--save", str(out / "ckpt"),
            "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"], *extra]
    script = os.path.join(ROOT, "pretrain_llama.py")
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)
    proc.elapsed = time.monotonic() - t0
    proc.out = out
    return proc


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


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_match_one_process(schedule, reference, tmp_path):
    # 4 micro-batches on 2 processes; decoupled uses 4 forward stages split d = 2.
    run = launch(tmp_path, schedule, 2, "--pipeline-schedule", schedule)
    assert_same_training(run, reference)
    assert metrics(run)[0]["schedule"] == schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_four_processes_match_one_process(schedule, reference, tmp_path):
    extra = ["--forward-stages", "4", "--backward-split", "2"] if schedule == "decoupled" else []
    run = launch(tmp_path, schedule, 4, "--pipeline-schedule", schedule, *extra)
    assert_same_training(run, reference)


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
    # A wide model on few tokens, so that the CPU optimizer is a large part of an iteration.
    heavy = ["--hidden-size", "256", "--ffn-hidden-size", "688", "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6",
             "--cpu-optimizer-threads", "1"]
    runs = {s: launch(tmp_path, s, 2, "--pipeline-schedule", s, *heavy)
            for s in ("decoupled", "mobius")}
    exposed = {}
    for schedule, run in runs.items():
        assert run.returncode == 0, run.stderr[-3000:]
        rows = metrics(run)[1:]  # the first iteration warms up
        exposed[schedule] = sum(r["exposed_optimizer_time_s"] for r in rows) / len(rows)
        for r in rows:
            assert r["gpu_time_s"] > 0 and r["bubble_time_s"] >= 0
            assert len(r["per_rank"]) == 2
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
    [(["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size"),
     (["--forward-stages", "9"], "--forward-stages"),
     (["--stage-layers", "3,3,3,3"], "--stage-layers"),
     (["--forward-stages", "4", "--backward-split", "3"], "--backward-split")],
)
def test_bad_pipeline_flags_fail_before_training(extra, flag, reference, tmp_path):
    run = launch(tmp_path, "bad", 2, "--pipeline-schedule", "decoupled", *extra, timeout=120)
    assert run.returncode != 0
    assert flag in run.stderr
    assert not (run.out / "metrics.jsonl").exists()
