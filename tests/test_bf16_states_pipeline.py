"""bf16 optimizer states and masters on real processes: schedules on 2 processes equal
one-process training with the same flags bit for bit (losses and the final master,
exp_avg and exp_avg_sq, saved in bf16), and a checkpoint of the one-process run resumed
on a 2-process 1F1B pipeline with another backward split continues it exactly. The
decoupled and the interleaved schedule (FEATURE_SCHEDULES) run in one job
(tests/run_schedules.py: the start-up is paid once); the rounding's independence of groups,
subgroups and threads is unit-tested in test_cpu_adam_bf16.py."""

import shutil

import pytest
import torch

from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER
from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from tests.test_pipeline_executor import FEATURE_SCHEDULES, ScheduleRun, metrics, start

pytestmark = pytest.mark.multiproc
# 3 iterations: the resume from the checkpoint of iteration 2 has one to continue, and
# two updates at a learning rate above 0 come before it (the last one's is 0: the
# schedule decays to it); a fourth adds nothing but CPU time
ITERS = 3
RESUMED_FROM = ITERS - 1
BF16_STATES = ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16",
               "--cpu-optimizer-threads", "1", "--eval-iters", "0", "--train-iters", str(ITERS)]
STATE_PREFIXES = (MASTER, EXP_AVG, EXP_AVG_SQ)


def states(ckpt_root, iteration):
    tensors = read_all_tensors(iteration_dir(str(ckpt_root), iteration))
    return {k: t for k, t in tensors.items() if k.startswith(STATE_PREFIXES)}


def assert_identical(got_run_metrics, want_metrics, got_states, want_states):
    assert [m["iteration"] for m in got_run_metrics] == [m["iteration"] for m in want_metrics]
    for a, b in zip(got_run_metrics, want_metrics):
        assert a["loss"] == b["loss"], (a["iteration"], a["loss"], b["loss"])
    assert got_states.keys() == want_states.keys()
    for key, tensor in want_states.items():
        assert tensor.dtype == torch.bfloat16, key  # stored in the run's precision
        assert torch.equal(got_states[key], tensor), key


def test_bf16_states_on_a_speculative_and_an_interleaved_schedule_and_a_resume_equal_one_process(
        tmp_path, demo_cache):
    one = start(tmp_path, "one", 1, *BF16_STATES, "--save-interval", str(RESUMED_FROM))
    two = start(tmp_path, "two", 2, *BF16_STATES, "--schedules", ",".join(FEATURE_SCHEDULES),
                script="tests/run_schedules.py", timeout=600)
    one = one.wait()  # started together: one's bubbles are the other's compute
    assert one.returncode == 0, one.stderr[-4000:]
    reference = metrics(one)
    assert [m["iteration"] for m in reference] == list(range(1, ITERS + 1))

    saved = tmp_path / "saved"  # the one-process run's iteration 2, as if it died there
    saved.mkdir()
    shutil.copytree(iteration_dir(str(one.out / "ckpt"), RESUMED_FROM),
                    iteration_dir(str(saved), RESUMED_FROM))
    (saved / TRACKER).write_text(str(RESUMED_FROM))
    # the resume needs only the one-process run: it starts beside the 2-process job's end
    resumed = start(tmp_path, "resumed", 2, *BF16_STATES, "--load", str(saved),
                    "--pipeline-schedule", "1f1b", "--backward-split", "1")
    two = two.wait()
    assert two.returncode == 0, two.stderr[-4000:]
    for name in FEATURE_SCHEDULES:
        run = ScheduleRun(two, name)
        assert_identical(metrics(run), reference, states(run.out / "ckpt", ITERS),
                         states(one.out / "ckpt", ITERS))

    resumed = resumed.wait()
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_identical(metrics(resumed), reference[RESUMED_FROM:],
                     states(resumed.out / "ckpt", ITERS), states(one.out / "ckpt", ITERS))
