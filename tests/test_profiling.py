"""Megatron's --profile --use-pytorch-profiler: a torch profiler trace of the chosen
iterations in --tensorboard-dir, each pipeline instruction a PP:<cell> range named as in the
executor's error grid."""

import glob
import json
import os

import pytest

from megatron.schedules.grid import cell
from megatron.schedules.instructions import Instruction, Op
from megatron.training.arguments import parse_args
from tests import forked_ranks
from tests.test_pipeline_executor import MODEL


@pytest.mark.multiproc
def test_the_profiled_iterations_are_traced_per_instruction_on_the_chosen_ranks(
        tmp_path, demo_cache):
    tb = tmp_path / "tb"
    args = [*MODEL, "--data-cache-dir", demo_cache, "--train-iters", "3", "--eval-iters", "0",
            "--pipeline-schedule", "1f1b", "--tensorboard-dir", str(tb), "--profile",
            "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
            "--profile-ranks", "1"]
    run = forked_ranks.launch("pretrain_llama.py", args, 2, env={"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    traces = glob.glob(str(tb / "*.pt.trace.json"))
    assert len(traces) == 1, os.listdir(tb)  # rank 1 only, one window
    with open(traces[0]) as f:
        names = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    ranges = [n for n in names if n.startswith("PP:")]
    # one iteration of rank 1's program: its forwards and backwards among them
    assert any(n.startswith("PP:F") for n in ranges) and any(n.startswith("PP:B") for n in ranges)
    codes = {cell(Instruction(op)) for op in Op}  # the grid's abbreviations
    assert all(n[3:].rstrip("0123456789:.>") in codes for n in ranges), set(ranges) - codes


@pytest.mark.parametrize("extra, flag", [
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], "--profile-step-end"),
])
def test_bad_profiling_flags_exit_2_naming_the_flag(extra, flag, capsys):
    with pytest.raises(SystemExit) as raised:
        parse_args([*MODEL, *extra])
    assert raised.value.code == 2
    assert flag in capsys.readouterr().err
