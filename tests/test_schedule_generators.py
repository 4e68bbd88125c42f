"""Schedule generators: assignment, partitions, shapes of the orders, bad input, CSV files."""

import pytest

from megatron.planning.search import searched_configurations
from megatron.planning.shape import build_run_schedule
from megatron.schedules.cost_model import uniform_costs
from megatron.schedules.generators import (
    SCHEDULE_KINDS,
    SCHEDULE_NAMES,
    ScheduleKind,
    build_schedule,
    decoupled_assignment,
)
from megatron.schedules.hardware import get_hardware
from megatron.schedules.instructions import Instruction, Op
from megatron.schedules.partition import balanced_partition, sub_stage_layers
from megatron.schedules.schedule_file import read_schedule, schedule_from_csv, write_schedule
from megatron.schedules.simulator import simulate
from megatron.schedules.validator import validate
from megatron.training.arguments import parse_args


def compute_order(schedule, rank):
    return [(ins.op, ins.stage, ins.sub, ins.mb) for ins in schedule.programs[rank]
            if ins.op in (Op.FORWARD, Op.BACKWARD)]


def test_paper_example_rank0_runs_backward_stages_7_1_5_1_3_1_1_1():
    # SysX Fig. 8: 4 GPUs, 8 forward and 16 backward stages.
    schedule = build_schedule("decoupled", 4, 8, 2, 4)
    backward_stages = []
    for op, stage, sub, _ in compute_order(schedule, 0):
        if op == Op.BACKWARD and (stage, sub) not in backward_stages:
            backward_stages.append((stage, sub))
    assert backward_stages == [(7, 1), (5, 1), (3, 1), (1, 1)]
    assert schedule.owned_by(0) == [(1, 1), (3, 1), (5, 1), (7, 1)]
    # Forward stages S0 and S4 on GPU0 (interleaved AFAB), all forwards before backwards.
    forwards = [stage for op, stage, _, _ in compute_order(schedule, 0) if op == Op.FORWARD]
    assert forwards == [0] * 4 + [4] * 4


def test_round_robin_assignment_in_reverse_model_order():
    ranks, stages, split = 3, 6, 4
    owners = decoupled_assignment(ranks, stages, split)
    reverse = sorted(owners, reverse=True)
    assert [owners[piece] for piece in reverse] == [i % ranks for i in range(stages * split)]


def test_mobius_is_interleaved_afab_with_coupled_assignment():
    schedule = build_schedule("mobius", 4, 8, 1, 4)
    order = compute_order(schedule, 1)
    assert order == ([(Op.FORWARD, s, -1, mb) for s in (1, 5) for mb in range(4)]
                     + [(Op.BACKWARD, s, 0, mb) for s in (5, 1) for mb in range(4)])
    programs = schedule.programs[1]
    ops = [ins.op for ins in programs]
    # Synchronized overflow check, then the CPU optimizer steps at the end.
    assert ops[-4:] == [Op.OVERFLOW_SYNC, Op.OPTIMIZER_START, Op.OPTIMIZER_START,
                        Op.OPTIMIZER_WAIT_ALL]


def test_decoupled_steps_each_stage_right_after_its_offload_and_rolls_back_at_the_end():
    schedule = build_schedule("decoupled", 4, 8, 2, 4)
    program = schedule.programs[0]
    for index, ins in enumerate(program):
        if ins.op == Op.OFFLOAD_GRAD:
            after = program[index + 1]
            assert (after.op, after.stage, after.sub) == (Op.OPTIMIZER_START, ins.stage, ins.sub)
    assert [ins.op for ins in program[-3:]] == [Op.OPTIMIZER_WAIT_ALL, Op.POST_STEP_SYNC,
                                                Op.ROLLBACK_IF_OVERFLOW]


def test_checkpoints_cross_ranks_only_when_the_backward_runs_elsewhere():
    schedule = build_schedule("decoupled", 2, 2, 2, 3)
    sent = {(ins.stage, ins.sub, ins.mb) for program in schedule.programs for ins in program
            if ins.op == Op.ISEND_CKPT}
    expected = {(stage, sub, mb) for stage in range(2) for sub in range(2) for mb in range(3)
                if (stage, sub) != (0, 0)
                and schedule.backward_rank[(stage, sub)] != schedule.forward_rank[stage]}
    assert sent == expected and sent


def test_1f1b_warmup_and_alternation():
    schedule = build_schedule("1f1b", 4, 4, 1, 6)
    kinds = "".join("F" if op == Op.FORWARD else "B" for op, *_ in compute_order(schedule, 1))
    assert kinds == "FF" + "FB" * 4 + "BB"


def test_interleaved_1f1b_uses_megatron_chunk_order():
    schedule = build_schedule("interleaved-1f1b", 2, 4, 1, 4)
    forwards = [(stage, mb) for op, stage, _, mb in compute_order(schedule, 0) if op == Op.FORWARD]
    # chunk c of rank 0 is stage 2c; micro-batches go through both chunks in groups of 2.
    assert forwards == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]


@pytest.mark.parametrize("layers,stages,emb,head", [(10, 4, 0, 0), (48, 8, 0, 0.74),
                                                    (13, 5, 2.5, 1.0), (5, 5, 0, 3)])
def test_balanced_partition_is_within_one_layer_of_the_best_split(layers, stages, emb, head):
    def stage_cost(first, count):
        return count + (emb if first == 0 else 0) + (head if first + count == layers else 0)

    # Reference: exhaustive dynamic programme over split points (min of the max stage cost).
    best = {(0, 0): 0.0}
    for stage in range(1, stages + 1):
        for used in range(stage, layers + 1):
            best[(stage, used)] = min(
                max(best[(stage - 1, start)], stage_cost(start, used - start))
                for start in range(stage - 1, used) if (stage - 1, start) in best)
    result = balanced_partition(layers, stages, 1.0, emb, head)
    assert sum(result) == layers and min(result) >= 1
    starts = [sum(result[:i]) for i in range(stages)]
    worst = max(stage_cost(start, count) for start, count in zip(starts, result))
    assert worst <= best[(stages, layers)] + 1.0


def test_sub_stages_are_contiguous_and_carry_embedding_and_head():
    ranges = sub_stage_layers([5, 3], 2)
    assert [(r.first, r.count) for r in ranges.values()] == [(0, 3), (3, 2), (5, 2), (7, 1)]
    assert ranges[(0, 0)].has_embedding and ranges[(1, 1)].has_head
    assert sum(r.has_embedding or r.has_head for r in ranges.values()) == 2


@pytest.mark.parametrize("args,message", [
    (("decoupled", 4, 8, 3, 4, [2] * 8), "backward split 3 is larger than the 2 layers"),
    (("decoupled", 4, 6, 1, 4, None), "forward_stages is 6, expected a multiple of ranks"),
    (("mobius", 4, 8, 1, 0, None), "micro_batches is 0"),
    (("gpipe", 4, 8, 1, 4, None), "one stage per rank"),
    (("mobius", 4, 8, 2, 4, None), "expects 1"),
    (("zero-bubble", 4, 8, 1, 4, None), "unknown"),
    (("decoupled", 2, 4, 1, 4, [1, 1, 0, 2]), "partition entry 2 is 0"),
])
def test_bad_input_is_a_one_line_value_error(args, message):
    with pytest.raises(ValueError, match=message) as error:
        build_schedule(*args)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_csv_round_trip_keeps_every_instruction(name, tmp_path):
    split = 2 if name == "decoupled" else 1
    stages = 2 if name in ("gpipe", "1f1b") else 4
    schedule = build_schedule(name, 2, stages, split, 4, partition=[3] * stages)
    path = tmp_path / "schedule.csv"
    write_schedule(schedule, str(path))
    assert read_schedule(str(path)) == schedule
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.csv"]


def test_hand_edited_csv_is_checked_by_the_validator(tmp_path):
    schedule = build_schedule("decoupled", 2, 2, 1, 2)
    text = write_and_read_text(schedule, tmp_path)
    # Drop rank 1's first prefetch: its first forward then runs without parameters.
    lines = text.splitlines()
    victim = next(i for i, line in enumerate(lines) if line.startswith("1,PREFETCH_PARAMS"))
    edited = schedule_from_csv("\n".join(lines[:victim] + lines[victim + 1:]))
    with pytest.raises(ValueError, match="rank 1, instruction #.*parameters prefetched"):
        validate(edited)


def write_and_read_text(schedule, tmp_path):
    path = tmp_path / "s.csv"
    write_schedule(schedule, str(path))
    return path.read_text()


@pytest.mark.parametrize("corruption,message", [
    (lambda t: t.replace("# pipeline-schedule v1", "hello"), "line 1"),
    (lambda t: t.replace("FORWARD", "FORWARDS", 1), "unknown op 'FORWARDS'"),
    (lambda t: t.replace("# ranks=2", "# ranks=two"), "ranks: 'two' is not an integer"),
    (lambda t: t.replace("\n0,", "\n7,", 1), "rank 7 is not in 0..1"),
])
def test_malformed_csv_names_the_problem(corruption, message, tmp_path):
    text = write_and_read_text(build_schedule("1f1b", 2, 2, 1, 2), tmp_path)
    with pytest.raises(ValueError, match=message):
        schedule_from_csv(corruption(text))


def _lifo_orders(ranks, stages, micro_batches, assignment):
    """GPipe with its backwards last in, first out: the schedule the next test adds."""
    return [[Instruction(Op.FORWARD, stage=r, mb=mb) for mb in range(micro_batches)]
            + [Instruction(Op.BACKWARD, stage=r, sub=0, mb=mb)
               for mb in reversed(range(micro_batches))]
            for r in range(ranks)]


def test_a_new_schedule_is_one_registry_entry(monkeypatch):
    # docs/schedules.md "Adding a schedule": the orders and one entry in generators.py;
    # the generator's checks, the lowering, validator, simulator, planner and search
    # take it from there.
    kind = ScheduleKind("gpipe-lifo", _lifo_orders, one_stage_per_rank=True,
                        searched_stages_per_rank=(1,))
    monkeypatch.setitem(SCHEDULE_KINDS, kind.name, kind)
    schedule = build_schedule(kind.name, 4, 4, 1, 4)
    report = validate(schedule)
    assert compute_order(schedule, 3)[4:] == [(Op.BACKWARD, 3, 0, mb) for mb in (3, 2, 1, 0)]
    costs = dict(forward_time=1.0, backward_time=2.0, optimizer_time=1.0)
    gpipe = build_schedule("gpipe", 4, 4, 1, 4)
    # mirrored micro-batch order, the same critical path as GPipe's
    assert simulate(schedule, uniform_costs(schedule, **costs), report).iteration_time == \
        pytest.approx(simulate(gpipe, uniform_costs(gpipe, **costs)).iteration_time)
    with pytest.raises(ValueError, match="gpipe-lifo expects one stage per rank"):
        build_schedule(kind.name, 2, 4, 1, 4)
    run = parse_args(["--model-preset", "tiny", "--plan"]).evolve(
        parallel={"pipeline_schedule": kind.name})
    planned = build_run_schedule(run, 2, run.model.planned_vocab_size)
    assert (planned.name, planned.forward_stages, planned.backward_split) == (kind.name, 2, 1)
    searched = searched_configurations(run, get_hardware("paper-v100"))
    assert {c.forward_stages for c in searched if c.schedule == kind.name} == {4}
