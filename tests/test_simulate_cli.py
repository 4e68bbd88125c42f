"""tools/simulate_pipeline.py as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.schedules.schedule_file import read_schedule

TOOL = str(Path(__file__).resolve().parents[1] / "tools" / "simulate_pipeline.py")
FIG8 = ["--schedule", "decoupled", "--ranks", "4", "--forward-stages", "8",
        "--backward-split", "2", "--micro-batches", "4"]
FIG2 = ["--schedule", "mobius", "--ranks", "4", "--forward-stages", "8",
        "--backward-split", "1", "--micro-batches", "4"]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_json_output_has_the_documented_keys():
    done = run(*FIG8, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["schedule"] == "decoupled"
    assert {"iteration_time", "bubble_ratio", "per_rank", "exposed_optimizer_time"} <= set(result)
    assert [row["rank"] for row in result["per_rank"]] == [0, 1, 2, 3]
    mean = sum(row["bubble_ratio"] for row in result["per_rank"]) / 4
    assert result["bubble_ratio"] == pytest.approx(mean)
    for row in result["per_rank"]:
        assert row["bubble_ratio"] == pytest.approx(1 - row["busy"] / result["iteration_time"])


def test_cost_options_change_the_result_and_decoupled_beats_mobius():
    costs = ["--optimizer-time", "2", "--param-transfer-time", "0.5", "--json"]
    mobius = json.loads(run(*FIG2, *costs).stdout)
    decoupled = json.loads(run(*FIG8, *costs).stdout)
    plain = json.loads(run(*FIG2, "--json").stdout)
    assert mobius["iteration_time"] > plain["iteration_time"]
    assert mobius["exposed_optimizer_time"] == pytest.approx(4.0)
    assert decoupled["bubble_ratio"] < mobius["bubble_ratio"]


def test_plot_trace_and_schedule_file_round_trip(tmp_path):
    done = run(*FIG8, "--plot", "t.png", "--trace", "t.json", "--schedule-file", "s.csv",
               "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    written = read_schedule(str(tmp_path / "s.csv"))
    assert written.name == "decoupled" and written.backward_split == 2
    again = run("--schedule-file", "s.csv", "--json", cwd=tmp_path)
    assert json.loads(again.stdout) == json.loads(done.stdout)


def test_edited_schedule_file_that_breaks_a_rule_exits_2(tmp_path):
    assert run(*FIG2, "--schedule-file", "s.csv", cwd=tmp_path).returncode == 0
    lines = (tmp_path / "s.csv").read_text().splitlines()
    lines.remove(next(line for line in lines if line.startswith("2,SEND_ACT")))
    (tmp_path / "s.csv").write_text("\n".join(lines) + "\n")
    done = run("--schedule-file", "s.csv", cwd=tmp_path)
    assert done.returncode == 2
    assert "rank" in done.stderr and "rule" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_model_preset_on_paper_hardware():
    done = run("--schedule", "decoupled", "--ranks", "4", "--forward-stages", "8",
               "--backward-split", "2", "--micro-batches", "8", "--model-preset", "10b",
               "--hardware", "paper-v100", "--micro-batch-size", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert 0 < result["bubble_ratio"] < 1 and result["iteration_time"] > 0


@pytest.mark.parametrize("args,needle", [
    (["--num-layers", "16", "--backward-split", "3"], "backward split 3 is larger than the 2"),
    (["--forward-stages", "6"], "forward_stages is 6, expected a multiple of ranks (4)"),
    (["--micro-batches", "0"], "--micro-batches 0"),
    (["--ranks", "0"], "--ranks 0"),
    (["--forward-time", "-1"], "--forward-time '-1'"),
    (["--partition", "1,x"], "--partition '1,x'"),
    (["--model-preset", "7b"], "unknown preset '7b'"),
])
def test_bad_input_is_one_line_and_exit_status_2(args, needle, tmp_path):
    done = run(*FIG8, *args, "--plot", "never.png", cwd=tmp_path)
    assert done.returncode == 2
    assert needle in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_missing_schedule_file_exits_2(tmp_path):
    done = run("--schedule-file", str(tmp_path / "nope.csv"))
    assert done.returncode == 2 and "file not found" in done.stderr


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "4", "--forward-stages", "8", "--micro-batches", "10000000"],
     "8 forward stages x 10000000 micro-batches"),
    (["--ranks", "100000", "--forward-stages", "200000", "--micro-batches", "4"],
     "200000 forward stages x 4 micro-batches"),
])
def test_an_absurd_size_is_refused_at_once_saying_the_limit(args, needle, tmp_path):
    done = run("--schedule", "decoupled", *args, "--plot", "never.png", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "expected at most" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_many_ranks_simulate_in_time_linear_in_the_instructions():
    """3000 ranks, one micro-batch: every round of the interpreter used to visit every rank
    (quadratic: minutes); now the ranks that can move are visited."""
    import time
    t0 = time.monotonic()
    done = run("--schedule", "decoupled", "--ranks", "3000", "--forward-stages", "6000",
               "--micro-batches", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["per_rank"]) == 3000
    assert time.monotonic() - t0 < 60


def test_a_binary_schedule_file_is_named_as_not_a_utf8_csv(tmp_path):
    path = tmp_path / "s.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 8)
    done = run("--schedule-file", str(path))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert str(path) in done.stderr and "is not a UTF-8 CSV" in done.stderr


def test_outputs_that_cannot_be_written_are_refused_before_simulating(tmp_path):
    """A directory or a file in the way of --plot/--trace/--schedule-file was an
    IsADirectoryError/NotADirectoryError traceback after the simulation; one process runs
    the three (the tool's imports are the cost). A missing directory is created."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    refused = [["--plot", "a_dir"], ["--trace", "a_file/t.json"],
               ["--schedule-file", "a_dir", "--plot", "new/dir/p.png"]]
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(TOOL).parent)!r})\n"
        "from simulate_pipeline import main\n"
        f"for outputs in {refused!r}:\n"
        "    try:\n"
        f"        main({FIG8!r} + outputs)\n"
        "    except SystemExit as exc:\n"
        "        print(exc.code)\n"
        f"main({FIG8!r} + ['--trace', 'new/dir/t.json'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.stdout.splitlines()[:3] == ["2", "2", "2"], done.stderr
    assert done.stderr.splitlines() == [
        "simulate_pipeline.py: error: --plot a_dir: expected a file path, found a directory",
        "simulate_pipeline.py: error: --trace a_file/t.json: its directory is not writable "
        f"(expected a writable directory ({tmp_path / 'a_file'} is a file))",
        "simulate_pipeline.py: error: --schedule-file a_dir: expected a file path, found a "
        "directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file", "new"]
    assert list((tmp_path / "a_dir").iterdir()) == []
    assert [p.name for p in (tmp_path / "new" / "dir").iterdir()] == ["t.json"]
