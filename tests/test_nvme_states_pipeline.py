"""Optimizer states on NVMe (--optimizer-state-location nvme) on real processes: every
schedule on 2 processes equals the same run with the states in host memory bit for bit
(losses, and the final master, exp_avg and exp_avg_sq), with gradient clipping on (a
clipping correction nearly every iteration), an injected overflow (a rollback) and bf16
states; ZeRO-2 with D = 2 likewise. Host memory holds exact snapshots for the comparison
(--optimizer-exact-rollback): the file's committed version makes the NVMe run's rollbacks
and corrections exact without one. No state file is left behind."""

import os

import pytest

from megatron.training.checkpointing import iteration_dir, read_all_tensors
from tests.test_bf16_states_pipeline import STATE_PREFIXES
from tests.test_pipeline_executor import SCHEDULES, ScheduleRun, metrics, start

pytestmark = pytest.mark.multiproc
FLAGS = ["--cpu-optimizer-threads", "1", "--eval-iters", "0", "--clip-grad", "0.5",
         "--loss-scale-window", "1000", "--hysteresis", "1", "--inject-overflow", "3,1,0"]


def final_states(run, iteration=5):
    tensors = read_all_tensors(iteration_dir(str(run.out / "ckpt"), iteration))
    return {k: t for k, t in tensors.items() if k.startswith(STATE_PREFIXES)}


def assert_identical(got, want):
    got_metrics, want_metrics = metrics(got), metrics(want)
    assert [m["iteration"] for m in got_metrics] == [1, 2, 3, 4, 5]
    for a, b in zip(got_metrics, want_metrics):
        assert a["loss"] == b["loss"], (a["iteration"], a["loss"], b["loss"])
        assert a.get("skipped") == b.get("skipped")
    got_states, want_states = final_states(got), final_states(want)
    assert got_states and got_states.keys() == want_states.keys()
    for key, tensor in want_states.items():
        assert got_states[key].equal(tensor), key


@pytest.mark.parametrize("extra", [[], ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"]],
                         ids=["fp32", "bf16"])
def test_every_schedule_with_states_on_disk_equals_host_memory(tmp_path, demo_cache, extra):
    disk = tmp_path / "drive"
    disk.mkdir()
    host = start(tmp_path, "host", 2, *FLAGS, *extra, "--optimizer-exact-rollback",
                 "--schedules", ",".join(SCHEDULES), script="tests/run_schedules.py",
                 timeout=600)
    nvme = start(tmp_path, "nvme", 2, *FLAGS, *extra, "--optimizer-state-location", "nvme",
                 "--optimizer-nvme-path", str(disk), "--schedules", ",".join(SCHEDULES),
                 script="tests/run_schedules.py", timeout=600)
    host, nvme = host.wait(), nvme.wait()
    assert host.returncode == 0, host.stderr[-4000:]
    assert nvme.returncode == 0, nvme.stderr[-4000:]
    assert "optimizer states on NVMe in" in nvme.stdout
    skipped = [m for m in metrics(ScheduleRun(host, "decoupled")) if m.get("skipped")]
    assert skipped, "the injected overflow did not skip an iteration"
    for name in SCHEDULES:
        assert_identical(ScheduleRun(nvme, name), ScheduleRun(host, name))
    assert os.listdir(disk) == []  # every state file removed at the end


def test_zero2_with_states_on_disk_equals_host_memory(tmp_path, demo_cache):
    disk = tmp_path / "drive"
    disk.mkdir()
    common = [*FLAGS, "--pipeline-model-parallel-size", "2", "--zero-stages", "2",
              "--schedules", "decoupled"]
    host = start(tmp_path, "host", 4, *common, "--optimizer-exact-rollback",
                 script="tests/run_schedules.py", timeout=600)
    nvme = start(tmp_path, "nvme", 4, *common, "--optimizer-state-location", "nvme",
                 "--optimizer-nvme-path", str(disk), script="tests/run_schedules.py",
                 timeout=600)
    host, nvme = host.wait(), nvme.wait()
    assert host.returncode == 0, host.stderr[-4000:]
    assert nvme.returncode == 0, nvme.stderr[-4000:]
    assert_identical(ScheduleRun(nvme, "decoupled-zero2"), ScheduleRun(host, "decoupled-zero2"))
    assert os.listdir(disk) == []
