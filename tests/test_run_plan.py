"""One RunPlan, built once: --plan prints it, the trainer builds the same one for its
machine and runs exactly it, and its prediction is checked against what the run
measured."""

import json

import pytest

from megatron.config.placement import ON_HOST, Interleaved
from megatron.planning.run_plan import Capacity, PredictedIteration, resolved_plan, run_start
from megatron.schedules import validator
from megatron.schedules.hardware import get_hardware
from megatron.schedules.optimizer_stride import UpdateRates
from megatron.training.arguments import parse_args
from megatron.training.training import main

TINY = ["--model-preset", "tiny", "--vocab-size", "4096", "--pipeline-schedule", "decoupled"]
# Deep Optimizer States' worked example (4 x V100): Eq. 1 gives the stride k = 2
PAPER_RATES = UpdateRates(3e9, 35e9, 2e9, 8.7e9)


def cpu_profile(tmp_path, gpus: int) -> str:
    """A profile of a CPU machine (the built-in V100 node's figures, the CPU layer's kind)."""
    data = json.loads(get_hardware("paper-v100").to_json())
    data.update(name="test-cpu", device_kind="cpu", gpus_per_node=gpus, gpu_memory_bytes=0,
                gpu_reserved_bytes=0, datasheet_peak_flops=None)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    return str(path)


def without_capacity(lines: list[str]) -> list[str]:
    """A plan's lines without what the machine has (the profile's or free now): the tables'
    last column and the /dev/shm line's capacity."""
    out = []
    for line in lines:
        if line.startswith(("rank ", "node ", "per GPU", "per node")):
            line = line.rsplit(maxsplit=1)[0]
        out.append(line.split(" GiB of ")[0])
    return out


def test_the_run_builds_and_prints_the_plan_that_plan_prints(tmp_path, capsys):
    """The trainer's plan of one rank (built as the run builds it, its memory held against
    what is free now) is --plan's on a profile of the same machine: the same schedule,
    memory and prediction, line for line but the capacities."""
    from megatron.config.device_choice import DeviceChoice
    from megatron.planning.report import describe
    from megatron.training.distributed import DistInfo
    from megatron.training.pipeline_step import plan_the_run

    hardware = cpu_profile(tmp_path, 1)
    assert main(["--plan", *TINY, "--hardware", hardware]) == 0
    # on one GPU --plan adds the largest model it trains, after the plan
    printed = [line for line in capsys.readouterr().out.strip().splitlines()
               if not line.startswith("largest LLaMA-2")]
    run = parse_args([*TINY, "--hardware", hardware])
    plan = plan_the_run(run, 4096, DistInfo(0, 1, 0, "gloo", 1, DeviceChoice("cpu", 0, "gloo")))
    assert plan.rank == 0 and plan.device_headroom_bytes is not None
    ours = describe(run, plan).splitlines()
    assert without_capacity(ours) == without_capacity(printed)
    assert "predicted iteration" in ours[-2] and plan.prediction.hardware == "test-cpu"


def count_validations(monkeypatch) -> list:
    seen = []
    real = validator._Checker.__init__

    def counting(self, schedule, *args, **kwargs):
        seen.append(schedule)
        real(self, schedule, *args, **kwargs)
    monkeypatch.setattr(validator._Checker, "__init__", counting)
    return seen


@pytest.mark.parametrize("stride", ["0", "2", "auto"])
def test_a_plan_validates_its_schedule_once(stride, monkeypatch):
    """Placing device subgroups (which simulates the schedule), the memory plan, the fit
    check's start and the prediction all read one validation."""
    from megatron.planning.run_plan import plan_on_profile

    run = parse_args([*TINY, "--optimizer-gpu-stride", stride, "--gpus-per-node", "2"])
    seen = count_validations(monkeypatch)
    plan = plan_on_profile(run, get_hardware("h100-sxm"))
    assert len(seen) == 1 and plan.simulation is not None
    seen.clear()
    run_start(run, 2, procs_per_node=2, on_cuda=False)
    assert len(seen) == 1


def test_auto_is_resolved_in_the_plan_and_the_pipeline_gets_the_split():
    """--optimizer-gpu-stride auto: the plan takes Eq. 1's split over the rates it is given,
    at the subgroup size the flag asks and the device memory left allows, plans its
    subgroups' memory, and the runtime's configuration carries exactly that; with too
    little device memory left, stride 0, said in words."""
    from megatron.pipeline.config import pipeline_config

    run = parse_args([*TINY, "--optimizer-gpu-stride", "auto", "--optimizer-subgroup-size",
                      "2048"])
    start = run_start(run, 2, procs_per_node=2, on_cuda=False)
    with_subgroups = [r for r in range(2) if any(
        i.op.name == "OPTIMIZER_START_SUBGROUPS" for i in start.schedule.programs[r])]
    assert with_subgroups
    rank = with_subgroups[0]
    plan = resolved_plan(run, start, {rank: 2**30}, lambda size: PAPER_RATES, None,
                         Capacity(None, 2**40, 2**40), rank)
    assert plan.placement.updates == Interleaved(2) and plan.placement.subgroup_size == 2048
    assert plan.memory.per_gpu[rank]["optimizer_subgroups"] > 0
    assert start.memory.per_gpu[rank]["optimizer_subgroups"] == 0  # the fit check's start
    assert "optimizer GPU stride k = 2 (auto; Eq. 1: 2.29" in plan.split_note
    assert plan.prediction is None  # no profile to price it on
    config = pipeline_config(run, plan)
    assert config.schedule is plan.schedule and config.report is plan.report
    assert config.placement == plan.placement
    squeezed = resolved_plan(run, start, {rank: 1000}, lambda size: PAPER_RATES, None,
                             Capacity(None, 2**40, 2**40), rank)
    assert squeezed.placement.updates == ON_HOST
    assert squeezed.memory.per_gpu[rank]["optimizer_subgroups"] == 0
    assert squeezed.split_note.startswith("optimizer GPU stride k = 0 (auto): ")


def test_the_run_summary_puts_the_prediction_beside_the_measured_iteration():
    from megatron.training.run_summary import RunOutcome, format_run_summary

    run = parse_args(TINY)
    predicted = PredictedIteration("test-cpu", 0.5, 0.3, 0.15, 0.05, 0.4, 0.1)
    records = [{"iteration": i, "loss": 1.0, "iter_time_s": t, "gpu_time_s": 0.3,
                "bubble_time_s": b, "exposed_optimizer_time_s": 0.05}
               for i, t, b in ((1, 3.0, 2.0), (2, 0.4, 0.05), (3, 0.42, 0.07), (4, 0.4, 0.05))]
    assert predicted.fields()["predicted_bubble_time_s"] == 0.15
    lines = format_run_summary(run, RunOutcome(records, 0, None, None, 10.0, True,
                                               prediction=predicted)).splitlines()
    assert lines[1] == ("  plan:        predicted iteration 0.500 s (test-cpu), measured 0.400 s "
                        "(the median of iterations 2-4): predicted/measured 1.25; off the "
                        "most: bubbles, 0.150 s predicted, 0.050 s measured")


def test_a_training_run_refuses_a_bad_hardware_profile_before_its_data(tmp_path, capsys):
    """The run's plan is priced on --hardware's profile: a file that is not one is refused
    in one line before the data phase, not after it."""
    bad = tmp_path / "hw.json"
    bad.write_text('{"name": "x",')
    with pytest.raises(SystemExit) as stop:
        main(["--model-preset", "tiny", "--train-iters", "1", "--hardware", str(bad),
              "--data-cache-dir", str(tmp_path / "cache")])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and f"--hardware {bad}" in err[0], err
    assert "setup: data" not in captured.out and not (tmp_path / "cache").exists()


def test_plan_plans_the_schedule_file_the_run_would_execute(tmp_path, capsys):
    """--plan of a run with --schedule-file prices the file's programs, as the run runs
    them (it used to plan the generated default instead)."""
    from megatron.planning.shape import generate_schedule
    from megatron.schedules.schedule_file import write_schedule

    path = tmp_path / "gpipe.csv"
    write_schedule(generate_schedule(parse_args([*TINY[:4], "--pipeline-schedule", "gpipe"]),
                                     2, 4096), str(path))
    assert main(["--plan", *TINY[:4], "--gpus-per-node", "2", "--schedule-file",
                 str(path)]) == 0
    assert ", gpipe, 2 forward stages" in capsys.readouterr().out.splitlines()[0]
