"""bench/paper_runs.py: the planner's prediction beside the paper's measured runs."""

import contextlib
import dataclasses
import io
import json

import pytest

import bench.paper_runs as paper_runs
from bench.paper_runs import MEASURED, Run, factor, summary, table
from megatron.schedules.hardware import get_hardware
from megatron.training.training import main


def test_a_row_is_what_plan_prints_beside_the_measured_times():
    """One Fig. 9 row: each system's predicted iteration is `--plan --json`'s for the
    run's own command line, its errors are predicted over measured, and the speedup is
    SysX's iteration over Mobius's."""
    [row] = table(get_hardware("paper-v100"), [("10b", 1024)])
    for system, (elapsed, gpu) in MEASURED[("10b", 1024)].items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(Run("10b", 1024, 2, 16, system).flags()) == 0
        planned = json.loads(out.getvalue())["configuration"]
        cell = row[system]
        assert cell["measured_s"] == [elapsed / 1e3, gpu / 1e3]
        assert cell["predicted_s"][0] == pytest.approx(planned["predicted_iteration_s"],
                                                       abs=1e-3)
        assert cell["ratio"][0] == pytest.approx(cell["predicted_s"][0] * 1e3 / elapsed,
                                                 abs=1e-3)
        assert 0 < cell["predicted_s"][1] < cell["predicted_s"][0]  # the GPU part
    speedup = row["speedup_over_mobius"]
    assert speedup["predicted"] == pytest.approx(
        row["mobius"]["predicted_s"][0] / row["spipe"]["predicted_s"][0], abs=1e-3)
    assert speedup["error"] == pytest.approx(speedup["predicted"] / speedup["measured"] - 1,
                                             abs=2e-3)
    result = summary([row])
    assert result["runs"] == 3
    assert result["elapsed_error_factor"]["max"] == round(
        max(factor(row[s]["ratio"][0], 1.0) for s in ("spipe", "mobius", "megatron")), 3)


def test_the_runs_are_the_authors_shapes_and_schedules():
    spipe = Run("40b", 2048, 2, 32, "spipe").flags()
    assert spipe[spipe.index("--hidden-size") + 1] == "5888"
    assert spipe[spipe.index("--ffn-hidden-size") + 1] == "15360"
    assert spipe[spipe.index("--forward-stages") + 1] == "16"  # 2 per GPU, 2 nodes
    assert spipe[spipe.index("--backward-split") + 1] == "3"
    assert "--backward-split" not in Run("40b", 2048, 2, 32, "mobius").flags()
    assert factor(0.5, 1.0) == factor(2.0, 1.0) == 2.0


def test_the_memory_check_lists_a_run_the_gpu_cannot_hold(monkeypatch):
    """A Fig. 9 run fits paper-v100's V100; on a GPU of 8 GiB the same run is listed as
    not fitting, by how much, with the terms of its fullest GPU."""
    run = Run("10b", 1024, 2, 16, "spipe")
    monkeypatch.setattr(paper_runs, "paper_runs", lambda: [run])
    v100 = get_hardware("paper-v100")
    fits = paper_runs.memory_check(v100)
    assert (fits["runs"], fits["planned_as_fitting"], fits["not_fitting"]) == (1, 1, [])
    small = dataclasses.replace(v100, gpu_memory_bytes=8 * 2**30)
    [short] = paper_runs.memory_check(small)["not_fitting"]
    assert short["model"] == "10b" and short["system"] == "spipe"
    assert short["short_gib"] == pytest.approx(short["gpu_gib"] - 7.5, abs=0.02)
    assert sum(short["terms_gib"].values()) == pytest.approx(short["gpu_gib"], abs=0.05)
