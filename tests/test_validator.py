"""The validator accepts every generated schedule and names the rule a broken one breaks."""

import dataclasses
import random

import pytest

from megatron.schedules.generators import SCHEDULE_NAMES, build_schedule
from megatron.schedules.instructions import Instruction, Op, transfer_batches
from megatron.schedules.interpreter import ScheduleError
from megatron.schedules.validator import validate


def sweep_configurations(count: int, seed: int = 3):
    """A seeded sample of (name, ranks 1..8, stages, d 1..4, micro-batches 1..16)."""
    valid = []
    for name in SCHEDULE_NAMES:
        for ranks in range(1, 9):
            for chunks in (1, 2, 3):
                if name in ("gpipe", "1f1b") and chunks > 1:
                    continue
                for split in range(1, 5) if name == "decoupled" else (1,):
                    for micro_batches in range(1, 17):
                        if name == "interleaved-1f1b" and chunks > 1 and micro_batches % ranks:
                            continue
                        valid.append((name, ranks, ranks * chunks, split, micro_batches))
    rng = random.Random(seed)
    corners = [("decoupled", 8, 16, 4, 16), ("decoupled", 1, 3, 4, 1), ("mobius", 8, 24, 1, 1),
               ("interleaved-1f1b", 8, 24, 1, 16), ("1f1b", 8, 8, 1, 1), ("gpipe", 1, 1, 1, 16)]
    return corners + rng.sample(valid, count)


@pytest.mark.parametrize("config", sweep_configurations(150), ids=str)
def test_every_generated_schedule_is_valid_with_bounded_residency(config):
    name, ranks, stages, split, micro_batches = config
    schedule = build_schedule(name, ranks, stages, split, micro_batches, [split + 1] * stages)
    report = validate(schedule)
    # Double buffering: at most two parameter segments (a forward stage is d pieces).
    assert max(report.peak_params) <= 2 * split
    # A rank never holds more checkpoints than exist for the stages it touches.
    assert max(report.peak_checkpoints) <= stages * split * micro_batches
    computes = sum(ins.op in (Op.FORWARD, Op.BACKWARD) for p in schedule.programs for ins in p)
    assert computes == stages * micro_batches * (1 + split)


def with_program(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def index_of(program, op, **fields):
    return next(i for i, ins in enumerate(program)
                if ins.op == op and all(getattr(ins, k) == v for k, v in fields.items()))


def moved(program, source, target):
    """The program with the instruction at `source` moved to position `target`."""
    program = list(program)
    program.insert(target, program.pop(source))
    return program


def expect(schedule, rank, rule, op=None):
    with pytest.raises(ScheduleError) as error:
        validate(schedule)
    message = str(error.value)
    assert error.value.rank == rank and error.value.rule == rule, message
    assert message.startswith(f"rank {rank}, ") and rule in message
    if op is not None:
        assert error.value.instruction.op == op and f"({error.value.instruction})" in message


def test_duplicate_forward_breaks_exactly_once():
    s = build_schedule("mobius", 2, 4, 1, 2)
    p = list(s.programs[0])
    i = index_of(p, Op.FORWARD, stage=0, mb=1)
    p.insert(i + 1, p[i])
    expect(with_program(s, 0, p), 0, "every forward and backward exactly once", Op.FORWARD)


def test_missing_backward_breaks_exactly_once():
    s = build_schedule("gpipe", 1, 1, 1, 1)
    p = [ins for ins in s.programs[0]
         if ins.op not in (Op.BACKWARD, Op.OFFLOAD_GRAD, Op.OPTIMIZER_START)]
    expect(with_program(s, 0, p), 0, "every forward and backward exactly once")


def test_forward_on_the_wrong_rank_breaks_assignment():
    s = build_schedule("mobius", 2, 4, 1, 2)
    broken = dataclasses.replace(s, forward_rank=(1, 0, 0, 1))
    expect(broken, 0, "compute on its assigned rank", Op.FORWARD)


def test_compute_without_prefetch_breaks_params_rule():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    p = list(s.programs[1])
    p.pop(index_of(p, Op.PREFETCH_PARAMS))
    expect(with_program(s, 1, p), 1, "parameters prefetched before compute", Op.FORWARD)


def test_forward_before_its_activation_arrives_breaks_inputs_rule():
    s = build_schedule("1f1b", 2, 2, 1, 2)
    p = s.programs[1]
    recv = index_of(p, Op.RECV_ACT, mb=0)
    broken = with_program(s, 1, moved(p, recv, index_of(p, Op.FORWARD, mb=0)))
    expect(broken, 1, "inputs produced before use", Op.FORWARD)


def test_backward_before_its_gradient_arrives_breaks_inputs_rule():
    s = build_schedule("decoupled", 2, 2, 1, 2)
    rank = s.backward_rank[(0, 0)]
    p = s.programs[rank]
    recv = index_of(p, Op.RECV_GRAD, mb=0)
    broken = with_program(s, rank, moved(p, recv, index_of(p, Op.BACKWARD, stage=0, mb=0)))
    expect(broken, rank, "inputs produced before use", Op.BACKWARD)


def test_recompute_before_waiting_for_the_checkpoint_breaks_inputs_rule():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    rank, program = next((r, p) for r, p in enumerate(s.programs)
                         if any(ins.op == Op.WAIT_CKPT for ins in p))
    wait = index_of(program, Op.WAIT_CKPT)
    w = program[wait]
    target = index_of(program, Op.BACKWARD, stage=w.stage, sub=w.sub, mb=w.mb)
    expect(with_program(s, rank, moved(program, wait, target)), rank,
           "inputs produced before use", Op.BACKWARD)


def test_wait_without_posted_receive_is_rejected():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    rank, program = next((r, p) for r, p in enumerate(s.programs)
                         if any(ins.op == Op.IRECV_CKPT for ins in p))
    program = list(program)
    program.pop(index_of(program, Op.IRECV_CKPT))
    expect(with_program(s, rank, program), rank, "checkpoint receive posted before its wait",
           Op.WAIT_CKPT)


def test_offload_before_the_last_micro_batch_breaks_gradient_rule():
    s = build_schedule("decoupled", 2, 4, 2, 3)
    p = s.programs[0]
    offload = index_of(p, Op.OFFLOAD_GRAD)
    o = p[offload]
    target = index_of(p, Op.BACKWARD, stage=o.stage, sub=o.sub, mb=2)
    expect(with_program(s, 0, moved(p, offload, target)), 0,
           "gradients complete before offload", Op.OFFLOAD_GRAD)


def test_optimizer_without_overflow_check_is_rejected():
    s = build_schedule("mobius", 2, 4, 1, 2)
    programs = tuple(tuple(i for i in p if i.op != Op.OVERFLOW_SYNC) for p in s.programs)
    expect(dataclasses.replace(s, programs=programs), 0,
           "optimizer step after offload and overflow check", Op.OPTIMIZER_START)


def test_optimizer_before_offload_is_rejected():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    p = s.programs[1]
    step = index_of(p, Op.OPTIMIZER_START)
    broken = with_program(s, 1, moved(p, step, step - 1))
    expect(broken, 1, "optimizer step after offload and overflow check", Op.OPTIMIZER_START)


def test_rollback_before_post_step_sync_is_rejected():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    p = s.programs[1]
    p = moved(p, index_of(p, Op.ROLLBACK_IF_OVERFLOW), index_of(p, Op.POST_STEP_SYNC))
    expect(with_program(s, 1, p), 1, "optimizer step after offload and overflow check",
           Op.ROLLBACK_IF_OVERFLOW)


RESIDENCY = "parameters prefetched when absent, released when resident and by the end"


def test_prefetch_of_parameters_never_released_is_rejected():
    s = build_schedule("mobius", 2, 4, 1, 2)
    p = list(s.programs[1])
    p.pop(index_of(p, Op.RELEASE_PARAMS))  # stage 1 after its forwards; fetched again later
    expect(with_program(s, 1, p), 1, RESIDENCY, Op.PREFETCH_PARAMS)


def test_parameters_left_resident_at_the_end_are_reported():
    s = build_schedule("mobius", 2, 4, 1, 2)
    p = list(s.programs[1])
    last = max(i for i, ins in enumerate(p) if ins.op == Op.RELEASE_PARAMS)
    p.pop(last)
    expect(with_program(s, 1, p), 1, RESIDENCY)


def test_release_of_absent_parameters_is_rejected():
    s = build_schedule("gpipe", 2, 2, 1, 2)
    p = list(s.programs[0])
    p.insert(0, Instruction(Op.RELEASE_PARAMS, stage=0, sub=-1))
    expect(with_program(s, 0, p), 0, RESIDENCY, Op.RELEASE_PARAMS)


def test_send_to_a_rank_without_matching_receive_is_rejected():
    s = build_schedule("1f1b", 3, 3, 1, 2)
    p = list(s.programs[0])
    i = index_of(p, Op.SEND_ACT)
    p[i] = dataclasses.replace(p[i], peer=2)
    expect(with_program(s, 0, p), 0, "every send matched by a receive", Op.SEND_ACT)


def test_a_send_and_a_receive_crossed_within_one_step_are_one_batch():
    # Rank 1 sends its first gradient right before receiving the second activation, while
    # rank 0 sends that activation right before receiving the gradient: as blocking calls
    # both sends would wait forever, but each rank posts its two transfers with the peer
    # as one batch (batch_isend_irecv), so they meet.
    s = build_schedule("1f1b", 2, 2, 1, 2)
    p = s.programs[1]
    recv = index_of(p, Op.RECV_ACT, mb=1)
    send = index_of(p, Op.SEND_GRAD, mb=0)
    p = moved(p, recv, send)
    assert index_of(p, Op.RECV_ACT, mb=1) == index_of(p, Op.SEND_GRAD, mb=0) + 1
    assert range(send - 1, send + 1) in transfer_batches(p)
    validate(with_program(s, 1, p))


def test_ranks_waiting_for_each_other_across_steps_deadlock():
    # Rank 0 waits for the first gradient before its second forward, whose activation rank
    # 1 waits for before the backward that produces that gradient.
    s = build_schedule("1f1b", 2, 2, 1, 2)
    p = s.programs[0]
    p = moved(p, index_of(p, Op.RECV_GRAD, mb=0), index_of(p, Op.FORWARD, mb=1))
    with pytest.raises(ScheduleError, match="no deadlock under blocking send/recv") as error:
        validate(with_program(s, 0, p))
    assert "RECV_GRAD stage=1 sub=0 mb=0 peer=1" in str(error.value)
    assert "rank 1 waits at #3 (RECV_ACT stage=0 mb=1 peer=0)" in str(error.value)


def test_receive_posted_but_never_used_is_dangling():
    s = build_schedule("decoupled", 2, 4, 2, 2)
    p = list(s.programs[0]) + [Instruction(Op.IRECV_CKPT, stage=3, sub=0, mb=9, peer=1)]
    expect(with_program(s, 0, p), 0, "every produced tensor used")


def test_receives_swapped_within_one_batch_are_rejected():
    """A batch is posted in program order, and NCCL matches a pair's transfers by that
    order inside a group too: two receives swapped in a batch would swap the tensors."""
    s = build_schedule("decoupled", 3, 6, 3, 6)
    for rank, program in enumerate(s.programs):
        for batch in transfer_batches(program):
            receives = [i for i in batch if program[i].op in (Op.RECV_ACT, Op.RECV_GRAD)]
            if len(receives) < 2:
                continue
            swapped = list(program)
            first, second = receives[:2]
            swapped[first], swapped[second] = swapped[second], swapped[first]
            assert transfer_batches(swapped) == transfer_batches(program)
            expect(with_program(s, rank, swapped), rank,
                   "sends and receives between two ranks posted in the same order")
            return
    raise AssertionError("no batch of two receives from one peer")


def pair_orders(schedule):
    """{(sender, receiver): (tensors in the sender's send order, in the receiver's order)}."""
    from megatron.schedules.instructions import POSTED_RECEIVES, POSTED_SENDS

    orders = {}
    for rank, program in enumerate(schedule.programs):
        for ins in program:
            if ins.op in POSTED_SENDS:
                orders.setdefault((rank, ins.peer), ([], []))[0].append(ins.tensor_key)
            elif ins.op in POSTED_RECEIVES:
                orders.setdefault((ins.peer, rank), ([], []))[1].append(ins.tensor_key)
    return orders


@pytest.mark.parametrize("config", sweep_configurations(60, seed=11), ids=str)
def test_every_generated_schedule_posts_each_pairs_transfers_in_one_order(config, tmp_path):
    """NCCL matches sends and receives between two ranks by posting order, not by tag."""
    from megatron.schedules.schedule_file import read_schedule, write_schedule

    name, ranks, stages, split, micro_batches = config
    generated = build_schedule(name, ranks, stages, split, micro_batches, [split + 1] * stages)
    write_schedule(generated, str(tmp_path / "s.csv"))
    for schedule in (generated, read_schedule(str(tmp_path / "s.csv"))):
        for pair, (sent, received) in pair_orders(schedule).items():
            assert sent == received, pair


def test_the_papers_fig8_setting_posts_checkpoints_and_activations_in_one_order():
    schedule = build_schedule("decoupled", 4, 8, 2, 4)
    orders = pair_orders(schedule)
    assert any(any(key[0] == "ckpt" for key in sent) and any(key[0] == "act" for key in sent)
               for sent, _ in orders.values())  # both kinds share pairs: order matters
    assert all(sent == received for sent, received in orders.values())


def test_receives_posted_out_of_the_senders_order_are_rejected():
    s = build_schedule("decoupled", 2, 4, 2, 4)
    # On a receiver, put a checkpoint receive right after the next activation receive from
    # the same sender: every tensor still arrives, but under NCCL the two would be swapped.
    for rank, program in enumerate(s.programs):
        for i, ins in enumerate(program):
            if ins.op != Op.IRECV_CKPT:
                continue
            later = next((j for j in range(i + 1, len(program))
                          if program[j].op == Op.RECV_ACT and program[j].peer == ins.peer), None)
            if later is None:
                continue
            broken = with_program(s, rank, moved(program, i, later))
            with pytest.raises(ScheduleError) as error:
                validate(broken)
            assert error.value.rule == "sends and receives between two ranks posted in the same order"
            assert error.value.rank == rank
            assert error.value.instruction.op in (Op.IRECV_CKPT, Op.RECV_ACT)
            assert f"from rank {ins.peer}" in str(error.value)
            return
    raise AssertionError("no checkpoint receive followed by an activation receive")
