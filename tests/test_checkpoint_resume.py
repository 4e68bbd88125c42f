"""Resuming continues the uninterrupted run. A run of 4 iterations with the default flags
(gradient clipping at 1.0: the norms of this model are 1.7-2.0, so every iteration clips)
saves at iteration 2; that checkpoint alone is resumed:

- on the same shape (decoupled, 4 forward stages, d = 2), in every mode with state of its
  own to carry: the default flags on 2 processes (the clip factor the speculative steps
  assume); fp16 loss scaling (a skipped iteration, a scale that grows after the resume)
  with device subgroups, on 2 processes; bf16 masters and moments with 2 data-parallel
  replicas of a 2-process pipeline. Iterations 3-4 give the same losses, norms and loss
  scales, and iteration 4's masters, m and v are equal bit for bit. tests/run_resume.py
  runs the uninterrupted run and its resume in one job; the modes' jobs start together.
- on another shape: 3 processes (decoupled, 3 stages, d = 1) bit for bit; 3 processes with
  1F1B and one process (no pipeline, run inside the test process) within 1e-5, because
  their optimizer clips each step directly where the decoupled one corrects a speculative
  step (docs/checkpoints.md, "Exactness").
- after a rank was killed while an async save was being written, from the checkpoint
  before it, by a job that ran beside the default mode's with the same losses.
"""

import json
import os
import shutil

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import STATE_PREFIXES
from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import train
from tests import forked_ranks
from tests.test_pipeline_executor import MODEL, Launch

pytestmark = pytest.mark.multiproc
TRAIN_ITERS, SAVED_AT = 4, 2
# The test model with the default --clip-grad (1.0), without evaluations or --p2p-check.
_CLIP = MODEL.index("--clip-grad")
FLAGS = [a for a in MODEL[:_CLIP] + MODEL[_CLIP + 2:] if a != "--p2p-check"]
FLAGS += ["--train-iters", str(TRAIN_ITERS), "--eval-iters", "0"]
SHAPE = ["--pipeline-schedule", "decoupled", "--forward-stages", "4", "--backward-split", "2"]
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2",
        "--inject-overflow", "1,1,0"]
DEVICE_SUBGROUPS = ["--optimizer-gpu-stride", "2"]
BF16_STATES = ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"]
DATA_PARALLEL = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"]
# mode: (processes, flags); two modes share a job where they touch different state
MODES = {
    "default": (2, []),
    "fp16+device-subgroups": (2, [*FP16, *DEVICE_SUBGROUPS]),
    "bf16-states+data-parallel": (4, [*BF16_STATES, *DATA_PARALLEL]),
}


def _start(out, nproc, script, *args, env=None):
    out.mkdir()
    job = forked_ranks.start(script, [*FLAGS, "--data-cache-dir",
                                      os.environ["MEGATRON_TEST_CACHE"], *args],
                             nproc, env={"OMP_NUM_THREADS": "1", **(env or {})})
    return Launch(job, out, nproc, args, timeout=600)


def _outputs(out):
    return ["--save", str(out / "ckpt"), "--metrics-file", str(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def started(tmp_path_factory, demo_cache):
    """Every mode's uninterrupted run and same-shape resume, started together; once the
    default mode's checkpoint is there, its resumes on 3 processes (both schedules in one
    job) start too."""
    root = tmp_path_factory.mktemp("resume")
    jobs = {mode: _start(root / mode, nproc, "tests/run_resume.py", *SHAPE, *flags,
                         "--out-dir", str(root / mode), "--resume-at", str(SAVED_AT))
            for mode, (nproc, flags) in MODES.items()}
    # beside the default mode, the same run as a job of its own with a --save of its own,
    # saving in the background after every iteration; its rank 1 is killed (SIGKILL) as
    # iteration 3 starts, when checkpoint 2 is being written
    jobs["killed"] = _start(root / "killed", 2, "pretrain_llama.py", *SHAPE, "--async-save",
                            "--save-interval", "1", *_outputs(root / "killed"),
                            env={"MEGATRON_SYSX_TEST_FAIL": "1,3,0,kill"})
    default = jobs["default"] = jobs["default"].wait()
    if default.returncode == 0:
        jobs["three"] = _start(root / "three", 3, "tests/run_schedules.py", "--load",
                               str(default.out / "saved"), "--backward-split", "1",
                               "--out-dir", str(root / "three"), "--schedules",
                               "decoupled,1f1b")
    return jobs


def finished(started, name):
    run = started[name]
    if isinstance(run, Launch):
        run = started[name] = run.wait()
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def metrics(directory):
    with open(directory / "metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "evaluation" not in row]


def states(directory):
    tensors = read_all_tensors(iteration_dir(str(directory / "ckpt"), TRAIN_ITERS))
    return {k: t for k, t in tensors.items() if k.startswith(STATE_PREFIXES)}


def assert_continues(resumed, straight, exact, norm_rel=0.0):
    """`norm_rel`: another shape sums the squared norm in another order."""
    assert [m["iteration"] for m in resumed] == list(range(SAVED_AT + 1, TRAIN_ITERS + 1))
    for got, want in zip(resumed, straight[SAVED_AT:], strict=True):
        for key in ("lr", "consumed_samples", "skipped", "loss_scale"):
            assert got[key] == want[key], (got["iteration"], key)
        if exact:
            assert got["loss"] == want["loss"], got["iteration"]
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=0), got["iteration"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=norm_rel, abs=0), \
            got["iteration"]


def assert_same_states(got, want, exact, dtype=torch.float32, rel=1e-5):
    """Bit for bit when `exact`, else each tensor within `rel` (relative 2-norm)."""
    assert sorted(got) == sorted(want)
    assert STATE_PREFIXES[0] + "decoder.layers.7.self_attention.linear_qkv.weight" in want
    for key, tensor in want.items():
        assert tensor.dtype == got[key].dtype == dtype, key  # saved in the run's precision
        if exact:
            assert torch.equal(got[key], tensor), key
        else:
            error = (got[key] - tensor).norm() / tensor.norm().clamp(min=1e-30)
            assert error < rel, (key, float(error))


def exercised(mode, rows):
    """Each mode's own path ran in the uninterrupted run (else the test proves nothing)."""
    assert all(r["grad_norm"] > 1.0 for r in rows if not r["skipped"])  # clipped, corrected
    if "fp16" in mode:  # a skip before the checkpoint, a growth after it
        assert [r["skipped"] for r in rows[:SAVED_AT]] == [True, False]
        # the logged scale is the one after the update: the checkpoint's, then grown
        assert rows[SAVED_AT]["loss_scale"] > rows[SAVED_AT - 1]["loss_scale"]
    if "device-subgroups" in mode:
        assert all(r["optimizer_gpu_stride"] == 2 for r in rows)
        assert all(max(rank["device_memory_at_peak"]["optimizer_subgroups"]
                       for rank in r["per_rank"]) > 0 for r in rows)
    if "data-parallel" in mode:  # 4 processes: 2 replicas of a 2-rank pipeline
        assert all(len(r["per_rank"]) == 2 for r in rows)


@pytest.mark.parametrize("mode", MODES)
def test_resume_on_the_same_shape_is_bit_exact(started, mode):
    run = finished(started, mode)
    straight = metrics(run.out / "straight")
    exercised(mode, straight)
    assert_continues(metrics(run.out / "resumed"), straight, exact=True)
    assert_same_states(states(run.out / "resumed"), states(run.out / "straight"), exact=True,
                       dtype=torch.bfloat16 if "bf16-states" in mode else torch.float32)


@pytest.mark.parametrize("schedule,exact", [
    ("decoupled", True),
    ("1f1b", False),  # clips directly, where the uninterrupted run corrected a speculation
])
def test_resume_on_three_processes(started, schedule, exact):
    default, three = finished(started, "default"), finished(started, "three")
    assert_continues(metrics(three.out / schedule), metrics(default.out / "straight"), exact,
                     norm_rel=1e-9 if exact else 1e-5)
    assert_same_states(states(three.out / schedule), states(default.out / "straight"), exact)


def test_a_rank_killed_during_an_async_save_resumes_exactly_beside_another_job(started,
                                                                             tmp_path):
    """A second job beside the default mode's, on another --save: until its rank 1 is
    killed its losses are the first job's, bit for bit (nothing is shared between jobs).
    The kill came while checkpoint 2 was written in the background (rank 1 was past its
    save): checkpoint 1 stays the last; resumed from it, the run continues the
    uninterrupted one bit for bit, losses and states."""
    killed = started["killed"].wait()
    straight = metrics(finished(started, "default").out / "straight")
    assert killed.returncode != 0
    before = metrics(killed.out)
    assert [m["iteration"] for m in before] == [1, 2], killed.stderr[-3000:]
    for got, want in zip(before, straight[:2], strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    ckpt = killed.out / "ckpt"
    assert (ckpt / TRACKER).read_text() == "1"  # checkpoint 2 was never committed
    assert not os.path.isdir(iteration_dir(str(ckpt), 2))
    resumed = _start(tmp_path / "resumed", 2, "pretrain_llama.py", *SHAPE, "--load", str(ckpt),
                     *_outputs(tmp_path / "resumed")).wait()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not bit for bit" not in resumed.stdout  # the same shape: nothing to say
    rows = metrics(resumed.out)
    assert [m["iteration"] for m in rows] == [2, 3, 4]
    for got, want in zip(rows, straight[1:], strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    assert_same_states(states(resumed.out), states(finished(started, "default").out /
                                                   "straight"), exact=True)


def test_resume_in_one_process(tmp_path, started, capsys):
    """One process without a pipeline, through train() here (no process to start); torch's
    AdamW: within 1e-5, not bit for bit, as its start-up line says."""
    default = finished(started, "default")
    saved = tmp_path / "saved"  # the checkpoint alone, as the resumed jobs read it
    shutil.copytree(default.out / "saved", saved)
    assert (saved / TRACKER).read_text() == str(SAVED_AT)
    out = tmp_path / "resumed"
    run = parse_args([*FLAGS, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"],
                      "--load", str(saved), "--save", str(out / "ckpt")])
    try:
        records = train(run, initialize_distributed())
    finally:
        shutdown_distributed()
    assert (f"resuming the checkpoint in {saved} with 1 process(es) (saved on 2), "
            "--pipeline-schedule single (saved with decoupled): it continues at the same "
            "sample within rounding of the run that saved it, not bit for bit"
            ) in capsys.readouterr().out
    assert_continues(records, metrics(default.out / "straight"), exact=False, norm_rel=1e-5)
    # torch's AdamW on gradients accumulated in another order: masters within 3e-7, but
    # the moments of the first iterations are small (v within 1.2e-5 at iteration 4)
    assert_same_states(states(out), states(default.out / "straight"), exact=False, rel=1e-4)
