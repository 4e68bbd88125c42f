"""Resume on another shape: a checkpoint saved at iteration 3 by 2 processes (decoupled,
4 forward stages, d = 2) continues on 3 processes (1F1B, 3 stages, d = 1) and on one
process (no pipeline) exactly like the uninterrupted run."""

import os
import shutil

import pytest
import torch

from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER
from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from tests.test_pipeline_executor import launch, metrics

pytestmark = pytest.mark.multiproc
SIX_ITERATIONS = ["--train-iters", "6"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    os.environ.setdefault("MEGATRON_TEST_CACHE", str(tmp_path_factory.mktemp("cache")))
    run = launch(tmp_path_factory.mktemp("two"), "two", 2, *SIX_ITERATIONS, "--save-interval",
                 "3", "--pipeline-schedule", "decoupled", "--forward-stages", "4",
                 "--backward-split", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def resume(tmp_path, uninterrupted, nproc, *flags):
    """Resume from the uninterrupted run's iteration-3 checkpoint (as if it died after)."""
    saved = tmp_path / "saved"
    saved.mkdir()
    shutil.copytree(iteration_dir(str(uninterrupted.out / "ckpt"), 3), saved / "iter_0000003")
    (saved / TRACKER).write_text("3")
    run = launch(tmp_path, "resumed", nproc, *SIX_ITERATIONS, "--load", str(saved), *flags)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.mark.parametrize("nproc,flags,exact", [
    (3, ["--pipeline-schedule", "1f1b", "--backward-split", "1"], True),
    (1, [], False),  # torch's AdamW in one process: equal within 1e-5, not bit for bit
])
def test_resume_on_another_shape_continues_the_uninterrupted_run(
        tmp_path, uninterrupted, nproc, flags, exact):
    run = resume(tmp_path, uninterrupted, nproc, *flags)
    resumed, full = metrics(run), metrics(uninterrupted)
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=0), got["iteration"]
        assert got["lr"] == want["lr"]
        assert got["consumed_samples"] == want["consumed_samples"]
    got = read_all_tensors(iteration_dir(str(run.out / "ckpt"), 6))
    want = read_all_tensors(iteration_dir(str(uninterrupted.out / "ckpt"), 6))
    names = [k for k in want if k.startswith((MASTER, EXP_AVG, EXP_AVG_SQ))]
    assert sorted(k for k in got if k.startswith((MASTER, EXP_AVG, EXP_AVG_SQ))) == sorted(names)
    assert "decoder.layers.7.self_attention.linear_qkv.weight" in {
        k.removeprefix(MASTER) for k in names}
    for key in names:
        if exact:
            assert torch.equal(got[key], want[key]), key
        else:
            error = (got[key] - want[key]).norm() / want[key].norm().clamp(min=1e-30)
            assert error < 1e-5, (key, float(error))
