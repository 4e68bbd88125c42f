"""READ/WRITE_OPTIMIZER_STATES in the schedule data: the lowering places them within the
window on every schedule, the validator refuses a program that steps a stage before its
read or writes it before its step, the simulator prices them on the node's drive, and
the memory model counts the window in host memory and the files on the drive."""

import dataclasses

import pytest

from megatron.config.presets import get_preset
from megatron.schedules.cost_model import DiskCosts, derived_costs, uniform_costs
from megatron.schedules.generators import SCHEDULE_NAMES, build_schedule
from megatron.schedules.hardware import get_hardware
from megatron.schedules.instructions import STATE_IO, BackwardStage, Instruction, Op
from megatron.schedules.interpreter import ScheduleError
from megatron.schedules.lowering import place_state_io
from megatron.schedules.memory_model import MemoryShape, plan_memory, shortfalls
from megatron.schedules.simulator import simulate
from megatron.schedules.validator import validate


def _decoupled(ranks=2, stages=4, split=2, micro_batches=4):
    return build_schedule("decoupled", ranks, stages, split, micro_batches)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("window", [1, 2, 3])
def test_every_schedule_reads_each_owned_stage_before_its_step_within_the_window(name, window):
    base = build_schedule(name, 4, 8 if name != "1f1b" and name != "gpipe" else 4,
                          2 if name == "decoupled" else 1, 8)
    placed = place_state_io(base, window)
    report = validate(placed)
    for rank, program in enumerate(placed.programs):
        owned = placed.owned_by(rank)
        reads = [BackwardStage(i.stage, i.sub) for i in program
                 if i.op == Op.READ_OPTIMIZER_STATES]
        assert sorted(reads) == sorted(owned)
        assert 1 <= report.peak_optimizer_states[rank] <= min(window, len(owned))
    # only the disk's instructions were added
    assert [[i for i in p if i.op not in STATE_IO] for p in placed.programs] == \
        [list(p) for p in base.programs]
    assert place_state_io(placed, window) is placed  # a program that has them is kept


def _without(schedule, rank, op, stage):
    programs = list(schedule.programs)
    programs[rank] = tuple(i for i in programs[rank]
                           if not (i.op == op and (i.stage, i.sub) == stage))
    return dataclasses.replace(schedule, programs=tuple(programs))


def test_a_step_without_its_read_or_a_write_before_its_step_is_refused():
    placed = place_state_io(_decoupled())
    rank = 0
    stage = tuple(placed.owned_by(rank)[0])
    with pytest.raises(ScheduleError, match="READ_OPTIMIZER_STATES of the stage before"):
        validate(_without(placed, rank, Op.READ_OPTIMIZER_STATES, stage))
    with pytest.raises(ScheduleError, match="states never written"):
        validate(_without(placed, rank, Op.WRITE_OPTIMIZER_STATES, stage))
    program = list(placed.programs[rank])
    write = next(i for i, ins in enumerate(program) if ins.op == Op.WRITE_OPTIMIZER_STATES)
    moved = program.pop(write)
    start = next(i for i, ins in enumerate(program) if ins.op == Op.OPTIMIZER_START
                 and (ins.stage, ins.sub) == (moved.stage, moved.sub))
    program.insert(start, moved)
    programs = list(placed.programs)
    programs[rank] = tuple(program)
    with pytest.raises(ScheduleError, match="written before its OPTIMIZER_START"):
        validate(dataclasses.replace(placed, programs=tuple(programs)))
    other = placed.owned_by(1)[0]
    programs = list(placed.programs)
    programs[0] = (Instruction(Op.READ_OPTIMIZER_STATES, *other), *programs[0])
    with pytest.raises(ScheduleError, match="not owned by this rank"):
        validate(dataclasses.replace(placed, programs=tuple(programs)))


def test_the_simulator_waits_for_reads_and_shares_one_drive_per_node():
    placed = place_state_io(_decoupled())
    base = uniform_costs(placed, optimizer_time=0.5)
    stages = placed.backward_stages()

    def disk(seconds, ranks_per_node):
        return dataclasses.replace(base, disk=DiskCosts({b: seconds for b in stages},
                                                        {b: seconds for b in stages},
                                                        ranks_per_node))
    fast = simulate(placed, disk(0.01, 2))
    slow = simulate(placed, disk(2.0, 2))
    apart = simulate(placed, disk(2.0, 1))  # one drive per rank: no sharing
    assert any(e.resource == "disk" for e in fast.events)
    assert slow.iteration_time > fast.iteration_time
    assert slow.state_io_busy_time > apart.state_io_busy_time  # both ranks on one drive
    assert slow.state_io_busy_time == pytest.approx(2.0 * 2 * len(stages))
    for e in slow.events:  # a step starts after its read ends
        if e.kind == "optimizer" and e.stage >= 0:
            read = next(r for r in slow.events if r.resource == "disk" and r.label[0] == "r"
                        and (r.stage, r.sub) == (e.stage, e.sub))
            assert e.start >= read.end
    with pytest.raises(ValueError, match="prices no disk"):
        simulate(placed, base)


def test_memory_model_counts_the_window_in_host_memory_and_both_versions_on_the_drive():
    model = get_preset("10b")
    hardware = get_hardware("dgx-h100")
    shape = build_schedule("decoupled", 4, 48, 1, 8, partition=tuple([1] * 48))
    host = plan_memory(shape, MemoryShape(model, 1), hardware=hardware)
    placed = place_state_io(shape)
    nvme = plan_memory(placed, MemoryShape(model, 1), hardware=hardware)
    states = sum(p["optimizer_states"] for p in host.per_process)
    # 12 stages per rank: a window of at most 2 of them and the scratch, one chunk of a stage
    window = sum(p["optimizer_states"] for p in nvme.per_process)
    assert states / 12 < window <= states * 2 / 12 * 1.05
    assert nvme.disk_per_node == (2 * states,)
    small = dataclasses.replace(hardware, nvme_capacity_bytes=states)
    assert [s.resource for s in shortfalls(nvme, small)] == ["nvme"]
    costs = derived_costs(placed, model, hardware, 1)
    b = placed.backward_stages()[0]
    assert costs.disk.read[b] < costs.disk.write[b]  # the profile's drives write slower


def test_a_schedule_file_with_the_disk_instructions_round_trips_and_shows_them_in_the_grid():
    from megatron.schedules.grid import format_programs
    from megatron.schedules.schedule_file import schedule_from_csv, schedule_to_csv

    placed = place_state_io(_decoupled())
    again = schedule_from_csv(schedule_to_csv(placed))
    assert again.programs == placed.programs
    read = next(i for i, ins in enumerate(placed.programs[0])
                if ins.op == Op.READ_OPTIMIZER_STATES)
    grid = format_programs(placed, mark=(0, read))
    assert "[RS" in grid and "RS=READ_OPTIMIZER_STATES" in grid
