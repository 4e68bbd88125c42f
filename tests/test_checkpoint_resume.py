"""Resume on another shape: a checkpoint saved at iteration 3 by 2 processes (decoupled,
4 forward stages, d = 2) continues on 3 processes (1F1B, 3 stages, d = 1) and on one
process (no pipeline, run inside the test process) like the uninterrupted run."""

import os
import shutil

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER
from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import train
from tests.test_pipeline_executor import MODEL, launch, metrics

pytestmark = pytest.mark.multiproc
SIX_ITERATIONS = ["--train-iters", "6"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_cache):
    run = launch(tmp_path_factory.mktemp("two"), "two", 2, *SIX_ITERATIONS, "--save-interval",
                 "3", "--pipeline-schedule", "decoupled", "--forward-stages", "4",
                 "--backward-split", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def saved_at_3(tmp_path, uninterrupted):
    """The uninterrupted run's iteration-3 checkpoint alone (as if the run died after it)."""
    saved = tmp_path / "saved"
    saved.mkdir()
    shutil.copytree(iteration_dir(str(uninterrupted.out / "ckpt"), 3), saved / "iter_0000003")
    (saved / TRACKER).write_text("3")
    return saved


def resume_on_three_processes(tmp_path, uninterrupted):
    run = launch(tmp_path, "resumed", 3, *SIX_ITERATIONS, "--load",
                 str(saved_at_3(tmp_path, uninterrupted)), "--pipeline-schedule", "1f1b",
                 "--backward-split", "1")
    assert run.returncode == 0, run.stderr[-4000:]
    return metrics(run), run.out / "ckpt"


def resume_in_this_process(tmp_path, uninterrupted):
    """One process without a pipeline, through train() here (no process to start)."""
    out = tmp_path / "resumed"
    run = parse_args([*MODEL, *SIX_ITERATIONS, "--data-cache-dir",
                       os.environ["MEGATRON_TEST_CACHE"], "--load",
                       str(saved_at_3(tmp_path, uninterrupted)), "--save", str(out / "ckpt")])
    try:
        records = train(run, initialize_distributed())
    finally:
        shutdown_distributed()
    return records, out / "ckpt"


@pytest.mark.parametrize("resume,exact", [
    (resume_on_three_processes, True),
    (resume_in_this_process, False),  # torch's AdamW: equal within 1e-5, not bit for bit
])
def test_resume_on_another_shape_continues_the_uninterrupted_run(
        tmp_path, uninterrupted, resume, exact):
    resumed, ckpt = resume(tmp_path, uninterrupted)
    full = metrics(uninterrupted)
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=0), got["iteration"]
        assert got["lr"] == want["lr"]
        assert got["consumed_samples"] == want["consumed_samples"]
    got = read_all_tensors(iteration_dir(str(ckpt), 6))
    want = read_all_tensors(iteration_dir(str(uninterrupted.out / "ckpt"), 6))
    names = [k for k in want if k.startswith((MASTER, EXP_AVG, EXP_AVG_SQ))]
    assert sorted(k for k in got if k.startswith((MASTER, EXP_AVG, EXP_AVG_SQ))) == sorted(names)
    assert MASTER + "decoder.layers.7.self_attention.linear_qkv.weight" in names
    for key in names:
        if exact:
            assert torch.equal(got[key], want[key]), key
        else:
            error = (got[key] - want[key]).norm() / want[key].norm().clamp(min=1e-30)
            assert error < 1e-5, (key, float(error))
