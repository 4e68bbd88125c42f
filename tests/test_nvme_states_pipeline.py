"""Optimizer states on NVMe (--optimizer-state-location nvme) on real processes: the
decoupled and the interleaved schedule (FEATURE_SCHEDULES) on 2 processes equal the same run with the states in host memory bit for bit
(losses, and the final master, exp_avg and exp_avg_sq), with gradient clipping on (a
clipping correction nearly every iteration), an injected overflow (a rollback) and bf16
states; ZeRO-2 with D = 2 and device subgroups likewise; a resume on another shape
continues exactly; host memory for the states stays the window. The comparisons run
without --optimizer-exact-rollback (both tiers invert AdamW) and, for ZeRO-2 and device
subgroups, with it (both exact: host memory from snapshots, NVMe from the file's committed
version). No state file is left behind (after a killed rank too: the kill test of
test_pipeline_executor.py runs with the states on NVMe)."""

import os
import shutil

import pytest

from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from tests.test_bf16_states_pipeline import STATE_PREFIXES
from tests.test_pipeline_executor import FEATURE_SCHEDULES, ScheduleRun, launch, metrics, start

pytestmark = pytest.mark.multiproc
# 4 iterations: the overflow's rollback at 3 has an iteration before and one after it, and
# the resume below stops at 3 (the test model's fifth adds nothing but CPU time)
ITERS = 4
FLAGS = ["--cpu-optimizer-threads", "1", "--eval-iters", "0", "--clip-grad", "0.5",
         "--loss-scale-window", "1000", "--hysteresis", "1", "--inject-overflow", "3,1,0",
         "--train-iters", str(ITERS)]


def final_states(run, iteration=ITERS):
    tensors = read_all_tensors(iteration_dir(str(run.out / "ckpt"), iteration))
    return {k: t for k, t in tensors.items() if k.startswith(STATE_PREFIXES)}


def assert_identical(got, want):
    got_metrics, want_metrics = metrics(got), metrics(want)
    assert [m["iteration"] for m in got_metrics] == list(range(1, ITERS + 1))
    for a, b in zip(got_metrics, want_metrics):
        assert a["loss"] == b["loss"], (a["iteration"], a["loss"], b["loss"])
        assert a.get("skipped") == b.get("skipped")
    got_states, want_states = final_states(got), final_states(want)
    assert got_states and got_states.keys() == want_states.keys()
    for key, tensor in want_states.items():
        assert got_states[key].equal(tensor), key


def test_schedules_with_states_on_disk_equal_host_memory(tmp_path, demo_cache):
    disk = tmp_path / "drive"
    disk.mkdir()
    host = start(tmp_path, "host", 2, *FLAGS, "--schedules", ",".join(FEATURE_SCHEDULES),
                 script="tests/run_schedules.py", timeout=600)
    nvme = start(tmp_path, "nvme", 2, *FLAGS, "--optimizer-state-location", "nvme",
                 "--optimizer-nvme-path", str(disk), "--schedules", ",".join(FEATURE_SCHEDULES),
                 script="tests/run_schedules.py", timeout=600)
    host, nvme = host.wait(), nvme.wait()
    assert host.returncode == 0, host.stderr[-4000:]
    assert nvme.returncode == 0, nvme.stderr[-4000:]
    assert "optimizer states on NVMe in" in nvme.stdout
    skipped = [m for m in metrics(ScheduleRun(host, "decoupled")) if m.get("skipped")]
    assert skipped, "the injected overflow did not skip an iteration"
    for name in FEATURE_SCHEDULES:
        assert_identical(ScheduleRun(nvme, name), ScheduleRun(host, name))
    assert os.listdir(disk) == []  # every state file removed at the end


def test_bf16_states_on_disk_equal_host_memory_and_resume_on_another_shape(tmp_path,
                                                                         demo_cache):
    """bf16 m, v and master; the NVMe run's checkpoint of iteration 3 resumed on another
    shape (one rank instead of two, another backward split; states on disk again)
    continues it exactly. (The same schedule: a
    speculative step corrected by the inverse ends a few ulps from a direct one, so a
    resume onto a schedule that steps directly continues exactly only with
    --optimizer-exact-rollback.)"""
    disk = tmp_path / "drive"
    disk.mkdir()
    bf16 = [*FLAGS, "--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"]
    # decoupled: speculative steps in bf16 on disk (the direct steps of the coupled
    # schedules on disk: the fp32 test above)
    each = ["--schedules", "decoupled", "--save-interval", "3",
            "--save", str(tmp_path / "ckpt")]  # the harness saves each schedule in its own
    on_disk = ["--optimizer-state-location", "nvme", "--optimizer-nvme-path", str(disk)]
    host = start(tmp_path, "host", 2, *bf16, *each, script="tests/run_schedules.py", timeout=600)
    nvme = start(tmp_path, "nvme", 2, *bf16, *each, *on_disk,
                 script="tests/run_schedules.py", timeout=600)
    nvme = nvme.wait()
    assert nvme.returncode == 0, nvme.stderr[-4000:]
    uninterrupted = ScheduleRun(nvme, "decoupled")
    saved = tmp_path / "saved"  # its iteration 3, as if it died there
    saved.mkdir()
    shutil.copytree(iteration_dir(str(uninterrupted.out / "ckpt"), 3), saved / "iter_0000003")
    (saved / TRACKER).write_text("3")
    # the resume needs only the NVMe run: it starts beside the end of the host-memory run
    resumed = start(tmp_path, "resumed", 1, *bf16, *on_disk, "--load", str(saved),
                    "--pipeline-schedule", "decoupled", "--backward-split", "1")
    host = host.wait()
    assert host.returncode == 0, host.stderr[-4000:]
    assert_identical(ScheduleRun(nvme, "decoupled"), ScheduleRun(host, "decoupled"))

    resumed = resumed.wait()
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    want = metrics(uninterrupted)[3:]
    assert [(m["iteration"], m["loss"]) for m in metrics(resumed)] == \
        [(m["iteration"], m["loss"]) for m in want]
    got_states, want_states = final_states(resumed), final_states(uninterrupted)
    assert got_states.keys() == want_states.keys()
    for key, tensor in want_states.items():
        assert got_states[key].equal(tensor), key
    assert os.listdir(disk) == []


def test_zero2_and_device_subgroups_with_states_on_disk_equal_host_memory(tmp_path,
                                                                        demo_cache):
    disk = tmp_path / "drive"
    disk.mkdir()
    common = [*FLAGS, "--pipeline-model-parallel-size", "2", "--zero-stages", "2",
              "--schedules", "decoupled",
              "--optimizer-gpu-stride", "device:3"]  # device subgroups in the window too
    host = start(tmp_path, "host", 4, *common, "--optimizer-exact-rollback",
                 script="tests/run_schedules.py", timeout=600)
    nvme = start(tmp_path, "nvme", 4, *common, "--optimizer-exact-rollback",
                 "--optimizer-state-location", "nvme",
                 "--optimizer-nvme-path", str(disk), script="tests/run_schedules.py",
                 timeout=600)
    host, nvme = host.wait(), nvme.wait()
    assert host.returncode == 0, host.stderr[-4000:]
    assert nvme.returncode == 0, nvme.stderr[-4000:]
    assert_identical(ScheduleRun(nvme, "decoupled-zero2"), ScheduleRun(host, "decoupled-zero2"))
    assert os.listdir(disk) == []


def host_state_bytes(run):
    return {m["host_optimizer_state_bytes"] for m in metrics(run)}


def test_host_memory_for_states_is_the_window_however_many_stages(tmp_path, demo_cache):
    """Twice the layers in twice the stages (each stage as large): the NVMe runs hold the
    same host bytes for optimizer states, less than half what host memory holds. One
    process (the one-rank decoupled pipeline) owns all the stages: the window is a
    process's, and a second rank would only halve what each one owns (and add its start-up
    to the suite's CPU)."""
    disk = tmp_path / "drive"
    disk.mkdir()
    on_disk = ["--optimizer-state-location", "nvme", "--optimizer-nvme-path", str(disk)]
    common = ["--eval-iters", "0", "--pipeline-schedule", "decoupled",
              "--backward-split", "2", "--ffn-hidden-size", "1024"]
    # two iterations on NVMe show that the window does not grow; the host-memory figure
    # is only compared with them: one iteration (no warmup: its learning rate is moot)
    # reports it
    iterations = {"nvme": ["--train-iters", "2", *on_disk],
                  "host": ["--train-iters", "1", "--lr-warmup-iters", "0"]}
    runs = {
        (layers, where): start(tmp_path, f"{where}{layers}", 1, *common, "--num-layers",
                               str(layers), "--forward-stages", str(layers // 2),
                               *iterations[where])
        for layers, where in ((8, "nvme"), (16, "nvme"), (16, "host"))}
    runs = {key: run.wait() for key, run in runs.items()}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-4000:]
    nvme8, nvme16 = host_state_bytes(runs[8, "nvme"]), host_state_bytes(runs[16, "nvme"])
    host16 = host_state_bytes(runs[16, "host"])
    assert len(nvme8) == len(nvme16) == 1
    assert nvme8 == nvme16
    assert max(nvme16) < max(host16) / 2
    assert os.listdir(disk) == []


@pytest.mark.parametrize("extra,expected", [
    (["--optimizer-nvme-path", "{missing}"], "an existing directory"),
    (["--optimizer-nvme-path", "{file}"], "a directory, not a file"),
    ([], "a directory on a local drive"),
    (["--optimizer-nvme-path", "{drive}", "--pipeline-schedule", "single"],
     "NVMe states need a pipeline"),
    (["--optimizer-nvme-path", "{drive}", "--optimizer-gpu-resident-fraction", "0.5"],
     "the static split"),
])
def test_bad_nvme_flags_are_one_line_and_exit_2(tmp_path, capsys, extra, expected):
    from megatron.training.arguments import parse_args

    (tmp_path / "file").write_text("x")
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "file", "drive": tmp_path}
    argv = ["--model-preset", "tiny", "--optimizer-state-location", "nvme",
            *[a.format(**paths) for a in extra]]
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "--optimizer-" in err[0]


def test_one_process_with_states_on_disk_runs_its_one_rank_pipeline(tmp_path, demo_cache):
    """Without a pipeline flag one process trains the whole model with torch's AdamW in
    memory; with the states on NVMe it runs the one-rank pipeline (the CPU optimizer and
    its disk tier) instead of ignoring the flag."""
    disk = tmp_path / "drive"
    disk.mkdir()
    run = launch(tmp_path, "one", 1, "--train-iters", "2", "--eval-iters", "0",
                 "--optimizer-state-location", "nvme", "--optimizer-nvme-path", str(disk))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "optimizer states on NVMe in" in run.stdout
    assert len(metrics(run)) == 2
    assert os.listdir(disk) == []
