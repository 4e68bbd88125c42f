"""A prediction a user can trust: tools/profile_hardware.py's profile of this machine prices
a real 2-process run of the tiny preset (bench/schedules.py --hardware) near its measured
iteration. The margin is generous (0.5-2): the profile and the run share a machine with
whatever else runs on it; docs/schedules.md has the figures over rounds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config.presets import get_preset
from megatron.schedules.hardware import layer_shape
from tests import forked_ranks

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_profile_based_prediction_is_near_the_measured_iteration(tmp_path, demo_cache):
    profile = tmp_path / "cpu.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "profile_hardware.py"), "--model-preset", "tiny",
         "--gpus-per-node", "2", "--out", str(profile)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(profile.read_text())
    assert measured["p2p_latency_s"] > 0 and measured["instruction_overhead_s"] > 0
    # compute measured at the planned model's layer (the tiny preset: micro-batch 4), with
    # the spread over its rounds
    assert measured["compute_shape"] == {**layer_shape(get_preset("tiny")),
                                         "micro_batch_sizes": [1, 4, 8], "dtype": "float32"}
    assert measured["compute_spread"] >= 0
    run = forked_ranks.launch(
        "bench/schedules.py",
        ["--model-preset", "tiny", "--train-iters", "4", "--rounds", "1", "--json",
         "--schedules", "decoupled,1f1b", "--hardware", str(profile),
         "--data-cache-dir", demo_cache],
        2, env={"OMP_NUM_THREADS": "1", "MEGATRON_DEVICE_SANITIZER": "0"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["hardware"] == str(profile)
    for row in summary["schedules"]:
        ratio = row["predicted_over_measured"]
        assert 0.5 < ratio < 2, (row["schedule"], row["predicted_iteration_time_s"],
                                 row["iteration_time_s"])
