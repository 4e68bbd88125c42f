"""tools/profile_hardware.py as a user runs it. A prediction a user can trust: its profile
of this machine prices a real 2-process run of the tiny preset (bench/schedules.py
--hardware) near its measured iteration. The margin is generous (0.5-2): the profile and
the run share a machine with whatever else runs on it, so the whole iteration is checked
where the machine kept its speed from the profile to the run, and the pricing of all but
the compute (at the run's own compute) always; docs/schedules.md has the figures over
rounds. The same profile measures a drive for NVMe states (--nvme-path) and removes
its file."""

import contextlib
import io
import json
import os

import pytest

from bench.nvme_optimizer import filesystem_of
from megatron.config.presets import get_preset
from megatron.optimizer.state_io import direct_io_supported
from megatron.schedules.hardware import layer_shape
from megatron.training.training import main
from tests import forked_ranks
from tests.test_run_plan import without_capacity

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


# what a failed check prints: the run's figures that tell the machine's drift from the pricing
FIGURES = ("iteration_time_s", "round_profile_predicted_over_measured",
           "predicted_over_measured", "at_run_compute_over_measured",
           "measured_over_predicted_compute", "run_compute_after_over_before",
           "fixed_work_after_over_before_run", "fixed_work_before_run_over_round_start")


def profile_hardware(*args: str):
    """`python tools/profile_hardware.py ARGS` (a fork of the session's preloaded zygote),
    without the device sanitizer, as the runs it prices below: its executor's pipeline
    times the instructions as those runs execute them."""
    return forked_ranks.launch("tools/profile_hardware.py", ["--model-preset", "tiny", *args],
                               env={"OMP_NUM_THREADS": "1", "MEGATRON_DEVICE_SANITIZER": "0"},
                               timeout=300)


def test_profile_based_prediction_is_near_the_measured_iteration(tmp_path, demo_cache):
    profile, drive = tmp_path / "cpu.json", tmp_path / "drive"
    drive.mkdir()
    on_a_drive = filesystem_of(str(drive)) not in ("tmpfs", "ramfs") and \
        direct_io_supported(str(drive))  # else the NVMe part is tested where it can be
    # 2 rounds of the layer's compute (the default 3): a spread over rounds, a round less
    done = profile_hardware("--gpus-per-node", "2", "--out", str(profile), "--rounds", "2",
                            "--vocab-size", "4096",  # the demo corpus's, the run's head
                            *(["--nvme-path", str(drive), "--nvme-bytes", "16MiB"]
                              if on_a_drive else []))
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(profile.read_text())
    if on_a_drive:
        assert measured["nvme_read_bytes_per_s"] > 0
        assert measured["nvme_write_bytes_per_s"] > 0
        assert measured["nvme_capacity_bytes"] > 0
        assert "NVMe" in measured["source"]
        assert [line for line in done.stderr.splitlines() if "profile_hardware: NVMe" in line]
        assert os.listdir(drive) == []  # the temporary file is gone
    assert measured["p2p_latency_s"] > 0 and measured["instruction_overhead_s"] > 0
    # the executor's one-layer stage against the stage alone, measured and printed
    assert measured["executor_compute_over_pass"] > 0
    assert [line for line in done.stderr.splitlines()
            if "a one-layer stage's FORWARD and BACKWARD there" in line]
    # compute measured at the planned model's layer (the tiny preset: micro-batch 4), with
    # the spread over its rounds
    assert measured["compute_shape"] == {**layer_shape(get_preset("tiny")),
                                         "micro_batch_sizes": [1, 4, 8], "dtype": "float32",
                                         "vocab_size": 4096}
    # the head measured at the run's vocabulary, beside the layer
    assert measured["head_rate_over_layer"] > 0
    assert measured["head_backward_over_forward"] is not None
    assert measured["compute_spread"] >= 0
    run = forked_ranks.launch(
        "bench/schedules.py",
        ["--model-preset", "tiny", "--train-iters", "4", "--rounds", "1", "--json",
         "--schedules", "decoupled,1f1b", "--hardware", str(profile), "--compute-each-run",
         "--out-dir", str(tmp_path / "runs"),
         "--data-cache-dir", demo_cache],
        2, env={"OMP_NUM_THREADS": "1", "MEGATRON_DEVICE_SANITIZER": "0"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["hardware"] == str(profile)
    for row in summary["schedules"]:
        figures = {key: row.get(key) for key in FIGURES}
        # the plan's pricing of all but the compute (transfers, per-instruction overheads,
        # the optimizer, the bubbles) at the compute the run itself delivered, against the
        # same traced iteration: within a factor 2 however loaded the machine (the suite's
        # other session shares it), as the machine's speed is on both sides
        assert 0.5 < row["at_run_compute_over_measured"] < 2, (row["schedule"], figures)
        # the profile measured above prices the whole run within a factor 2 where the
        # machine kept its speed: its compute just before the run as priced within 0.8-1.25
        # of the profile's, and the layer's FORWARD after the run within that of before it.
        # A run beside a heavy test of the other session ran at 0.42 of the profile's
        # prediction: the machine's, not the prediction's, which the check above prices
        ratio = row["round_profile_predicted_over_measured"]
        since_profile = ratio / row["predicted_over_measured"]
        if 0.8 < since_profile < 1.25 and 0.8 < row["run_compute_after_over_before"] < 1.25:
            assert 0.5 < ratio < 2, (row["schedule"], figures)
        assert row["predicted_over_measured"] > 0
        # the compute re-measured right before the run priced it; the file's prediction and
        # the machine's drift across the run beside it
        assert row["run_compute_forward_s"] > 0
        assert row["run_compute_backward_s"] > row["run_compute_forward_s"]
        assert row["round_profile_predicted_over_measured"] > 0
        assert row["fixed_work_after_over_before_run"] > 0
        assert row["run_compute_after_over_before"] > 0
    assert summary["predicted_over_measured_all_runs"]["runs"] == 2
    # each run printed its plan: --plan's for the same flags on the profile it was priced
    # on (the file's, its compute re-measured before the run), but for the capacities
    # (what is free now, where --plan has the profile's)
    for name in ("decoupled", "1f1b"):
        priced_on = tmp_path / "runs" / name / "hardware.json"
        assert json.loads(priced_on.read_text())["p2p_latency_s"] == measured["p2p_latency_s"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["--plan", "--model-preset", "tiny", "--vocab-size", "4096",
                         "--pipeline-schedule", name, "--hardware", str(priced_on)]) == 0
        planned = without_capacity(out.getvalue().strip().splitlines())
        start = run.stderr.index(planned[0])
        printed = without_capacity(run.stderr[start:].splitlines()[:len(planned)])
        assert printed == planned, name


def test_nvme_path_on_tmpfs_is_refused_in_one_line():
    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    done = profile_hardware("--nvme-path", "/dev/shm")  # refused before anything is measured
    assert done.returncode == 2
    assert "tmpfs" in done.stderr.strip().splitlines()[-1]
