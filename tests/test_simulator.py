"""The simulator against SysX's closed forms and the paper's Fig. 2 / Fig. 8 comparison."""

import json

import pytest

from megatron.config.model import count_parameters
from megatron.config.presets import get_preset
from megatron.schedules.cost_model import (
    derived_costs,
    model_partition,
    rollback_time,
    uniform_costs,
)
from megatron.schedules.generators import build_schedule
from megatron.schedules.hardware import HARDWARE_PROFILES, HardwareProfile, get_hardware
from megatron.schedules.instructions import BLOCKING_RECVS, BLOCKING_SENDS
from megatron.schedules.simulator import simulate
from megatron.schedules.timeline import write_chrome_trace, write_timeline_png


def eq3_bubble_ratio(ranks, micro_batches, tf, tb):
    """SysX Eq. (3)."""
    return ((tf * (ranks - 1) + tb * (ranks - 1))
            / (tf * (micro_batches + ranks - 1) + tb * (micro_batches + ranks - 1)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tf,tb", [(1.0, 2.0), (1.0, 1.0), (0.7, 2.3), (2.0, 1.0)])
def test_bubble_ratio_equals_eq3_for_gpipe_and_1f1b(name, tf, tb):
    for ranks in range(1, 9):
        for micro_batches in (1, 2, 3, 4, 5, 7, 8, 12, 16):
            schedule = build_schedule(name, ranks, ranks, 1, micro_batches)
            result = simulate(schedule, uniform_costs(schedule, forward_time=tf, backward_time=tb))
            expected = eq3_bubble_ratio(ranks, micro_batches, tf, tb)
            assert result.bubble_ratio == pytest.approx([expected] * ranks, abs=1e-12)
            assert result.iteration_time == pytest.approx((micro_batches + ranks - 1) * (tf + tb))


FIG2 = ("mobius", 4, 8, 1, 4)  # SysX Fig. 2: 4 GPUs, 8 stages, 4 micro-batches
FIG8 = ("decoupled", 4, 8, 2, 4)  # SysX Fig. 8: 8 forward, 16 backward stages


@pytest.mark.parametrize("costs", [
    {},
    {"optimizer_time": 2.0, "param_transfer_time": 0.5, "grad_transfer_time": 0.5},
    {"optimizer_time": 6.0, "param_transfer_time": 1.0, "grad_transfer_time": 1.0,
     "recompute_time": 1.0, "p2p_time": 0.1},
])
def test_decoupled_has_fewer_bubbles_than_mobius_in_the_paper_setting(costs):
    results = {}
    for config in (FIG2, FIG8):
        schedule = build_schedule(*config)
        results[config[0]] = simulate(schedule, uniform_costs(schedule, **costs))
    assert results["decoupled"].mean_bubble_ratio < results["mobius"].mean_bubble_ratio
    assert results["decoupled"].iteration_time < results["mobius"].iteration_time
    # Same work on every GPU in both schedules.
    assert results["decoupled"].busy == pytest.approx(results["mobius"].busy)


def test_mobius_optimizer_is_fully_exposed_and_decoupled_hides_all_but_the_last():
    costs = {"optimizer_time": 2.0, "grad_transfer_time": 0.25}
    mobius = simulate(build_schedule(*FIG2), uniform_costs(build_schedule(*FIG2), **costs))
    decoupled = simulate(build_schedule(*FIG8), uniform_costs(build_schedule(*FIG8), **costs))
    # Mobius: every rank steps its 2 stages after the synchronized check, in parallel.
    assert mobius.exposed_optimizer_time == pytest.approx(2 * 2.0)
    assert all(e.start >= mobius.compute_end for e in mobius.events
               if e.resource == "cpu-optimizer")
    # Decoupled: a backward stage's step (2.0 / d = 1) is shorter than the backwards that
    # follow it, so only steps of the last backward stages remain exposed.
    assert 0 < decoupled.exposed_optimizer_time <= 2.0 / 2 + 0.25
    assert any(e.end <= decoupled.compute_end for e in decoupled.events
               if e.resource == "cpu-optimizer")


def test_events_respect_dependencies_and_resources():
    schedule = build_schedule(*FIG8)
    result = simulate(schedule, uniform_costs(schedule, optimizer_time=1.0, p2p_time=0.2,
                                              param_transfer_time=0.5, grad_transfer_time=0.5))
    by_key = {}
    for event in result.events:
        by_key[(event.kind, event.stage, event.sub, event.mb)] = event
    for rank in range(schedule.ranks):
        compute = sorted((e.start, e.end) for e in result.events
                         if e.rank == rank and e.resource == "compute")
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(compute, compute[1:]))
    for (kind, stage, sub, mb), event in by_key.items():
        if kind == "backward":
            forward = by_key[("forward", stage, -1, mb)]
            assert event.start >= forward.end + 0.2 - 1e-9 or \
                schedule.backward_rank[(stage, sub)] == schedule.forward_rank[stage]
        if kind == "optimizer":
            assert event.start >= by_key[("offload", stage, sub, -1)].end
        if kind == "forward" and stage > 0:
            assert event.start >= by_key[("forward", stage - 1, -1, mb)].end + 0.2 - 1e-9


def test_derived_costs_follow_the_parameter_count_and_hardware():
    preset = get_preset("10b")
    stages = 8
    schedule = build_schedule("decoupled", 4, stages, 2, 8, model_partition(preset, stages))
    costs = derived_costs(schedule, preset, "paper-v100", micro_batch_size=2)
    total = count_parameters(preset.num_layers, preset.hidden_size, preset.ffn_hidden_size,
                             preset.num_attention_heads, preset.num_query_groups,
                             preset.vocab_size).total
    # fp16 parameters over ~12 GB/s PCIe; the pieces add up to the whole model.
    assert sum(costs.param_transfer.values()) == pytest.approx(2 * total / 12e9)
    # The node's CPU Adam rate shared by its 4 GPUs.
    hardware = get_hardware("paper-v100")
    assert sum(costs.optimizer.values()) == pytest.approx(
        total / (hardware.cpu_optimizer_params_per_s / 4))
    # Every forward and backward pass pays the profile's host overhead once.
    overhead = hardware.pass_overhead_s
    for piece, backward in costs.backward.items():
        assert backward == pytest.approx(2 * costs.recompute[piece] + overhead)
    assert sum(costs.forward) == pytest.approx(sum(costs.recompute.values()) + stages * overhead)
    # The balanced partition evens out the head's extra cost.
    assert max(costs.forward) / min(costs.forward) < 1.25


def test_pass_overhead_is_zero_unless_a_profile_sets_it_and_adds_once_per_pass():
    assert all(HARDWARE_PROFILES[name].pass_overhead_s == 0.0
               for name in ("h100-sxm", "dgx-h100"))
    preset = get_preset("10b")
    schedule = build_schedule("decoupled", 4, 8, 3, 4, model_partition(preset, 8, min_layers=3))
    base = get_hardware("h100-sxm")
    plain = derived_costs(schedule, preset, base, micro_batch_size=2)
    slow = derived_costs(schedule, preset,
                         HardwareProfile(
                             **{**vars(base), "pass_overhead_s": 0.05}), micro_batch_size=2)
    assert slow.forward == pytest.approx([t + 0.05 for t in plain.forward])
    assert all(slow.backward[b] == pytest.approx(plain.backward[b] + 0.05) for b in plain.backward)
    assert slow.recompute == plain.recompute and slow.optimizer == plain.optimizer


def test_rollback_costs_one_more_optimizer_pass_of_the_slowest_rank():
    preset = get_preset("10b")
    schedule = build_schedule("decoupled", 4, 8, 3, 4, model_partition(preset, 8, min_layers=3))
    costs = derived_costs(schedule, preset, "paper-v100", micro_batch_size=2)
    per_rank = [sum(costs.optimizer[b] for b in schedule.owned_by(r)) for r in range(4)]
    assert rollback_time(schedule, costs) == pytest.approx(max(per_rank))
    assert rollback_time(schedule, uniform_costs(schedule)) == 0.0


def test_timeline_png_and_chrome_trace(tmp_path):
    schedule = build_schedule(*FIG8)
    result = simulate(schedule, uniform_costs(schedule, optimizer_time=2.0,
                                              param_transfer_time=0.5, grad_transfer_time=0.5))
    png, trace = tmp_path / "fig8.png", tmp_path / "fig8.json"
    write_timeline_png(result.events, str(png), title="decoupled")
    write_chrome_trace(result.events, str(trace))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = json.loads(trace.read_text())["traceEvents"]
    spans = [r for r in records if r["ph"] == "X"]
    assert len(spans) == len(result.events)
    assert {r["args"]["name"] for r in records if r["name"] == "thread_name"} == {
        "compute", "h2d", "d2h", "cpu-optimizer"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig8.json", "fig8.png"]


@pytest.mark.parametrize("name,split", [("decoupled", 3), ("mobius", 1), ("1f1b", 1)])
def test_blocking_transfers_do_not_serialize_along_the_pipeline(name, split):
    # Each blocking transfer holds its two ranks for p2p_time. Pairs meeting at the same time
    # along the chain of ranks must run side by side, so a rank is delayed by its own
    # transfers plus one per stage boundary crossed by the fill and the drain (2 per forward
    # stage), not by everyone's transfers one after another.
    ranks = 8
    stages = ranks if name == "1f1b" else 2 * ranks
    schedule = build_schedule(name, ranks, stages, split, 16, [3] * stages, backward_ratio=3.0)
    costs = {"recompute_time": 1.0}
    base = simulate(schedule, uniform_costs(schedule, **costs)).iteration_time
    p2p = 0.01
    slowed = simulate(schedule, uniform_costs(schedule, p2p_time=p2p, **costs)).iteration_time
    blocking = max(sum(ins.op in BLOCKING_SENDS or ins.op in BLOCKING_RECVS for ins in program)
                   for program in schedule.programs)
    assert base < slowed <= base + p2p * (blocking + 2 * stages)


def test_shared_lane_ends_against_hand_worked_cases():
    """`shared_lane_ends`: n updates in progress each advance at min(share, 1/n)."""
    from megatron.schedules.simulator import shared_lane_ends

    # two at once share the lane: both end at their summed work, whatever the share >= 1/2
    assert shared_lane_ends([(0.0, 1.0), (0.0, 1.0)], 1.0) == pytest.approx([2.0, 2.0])
    assert shared_lane_ends([(0.0, 1.0), (0.0, 1.0)], 0.5) == pytest.approx([2.0, 2.0])
    # one alone runs at its share: 1 / 0.5
    assert shared_lane_ends([(3.0, 1.0)], 0.5) == pytest.approx([5.0])
    # 0-0.5 alone at 0.8 (0.4 done); both at 0.5 until the first's 0.6 left is done at 1.7
    # (the second has 0.6 done by then); the second alone: 0.4 / 0.8 more
    assert shared_lane_ends([(0.0, 1.0), (0.5, 1.0)], 0.8) == pytest.approx([1.7, 2.2])
    # apart in time: each alone, none waits for the other
    assert shared_lane_ends([(0.0, 1.0), (5.0, 2.0)], 0.5) == pytest.approx([2.0, 9.0])


def test_single_update_share_slows_the_lone_last_update_not_the_synchronous_ones():
    """The decoupled schedule's last update runs alone after the compute: its exposed part
    takes 1/share as long; Mobius steps its two equal stages together after the check, which
    reach the lane's whole rate either way."""
    from dataclasses import replace

    results = {}
    for config in (FIG2, FIG8):
        schedule = build_schedule(*config)
        costs = uniform_costs(schedule, optimizer_time=0.5)  # no backlog: each update alone
        results[config[0]] = [simulate(schedule, replace(costs, single_update_share=share))
                              for share in (1.0, 0.5)]
    whole, half = results["decoupled"]
    assert half.exposed_optimizer_time == pytest.approx(2 * whole.exposed_optimizer_time)
    assert half.compute_end == pytest.approx(whole.compute_end)
    whole, half = results["mobius"]
    assert half.iteration_time == pytest.approx(whole.iteration_time)


def test_single_update_share_is_checked_and_reaches_the_cost_model():
    from dataclasses import replace

    v100 = get_hardware("paper-v100")
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="single_update_share"):
            replace(v100, single_update_share=bad)
    schedule = build_schedule("decoupled", 4, 8, 2, 8,
                              model_partition("10b", 8, min_layers=2))
    costs = derived_costs(schedule, "10b", replace(v100, single_update_share=0.6), 2)
    assert costs.single_update_share == 0.6
    assert derived_costs(schedule, "10b", "h100-sxm", 2).single_update_share == 1.0


@pytest.mark.unit
@pytest.mark.parametrize("name,stages", [("decoupled", 4), ("mobius", 4), ("gpipe", 1)])
def test_every_instruction_pays_the_dispatch_alike(name, stages):
    """The cost model's `instruction` (the executor's host time per instruction) is paid
    once by every instruction, compute, transfers and collectives alike: one rank, where
    nothing waits on a peer, lasts its compute plus one dispatch per instruction; on two,
    each rank's clock pays its own program's dispatches, and no more than both programs'
    delay the iteration."""
    from dataclasses import replace
    dispatch = 0.01
    one = build_schedule(name, 1, stages, 1, 2)
    free = uniform_costs(one)
    alone = simulate(one, replace(free, instruction=dispatch)).iteration_time
    assert alone == pytest.approx(simulate(one, free).iteration_time
                                  + dispatch * len(one.programs[0]))
    two = build_schedule(name, 2, max(stages, 2), 1, 2)
    free = uniform_costs(two, p2p_time=0.05)
    base = simulate(two, free)
    priced = simulate(two, replace(free, instruction=dispatch))
    for rank, program in enumerate(two.programs):
        assert priced.iteration_time >= base.busy[rank] + dispatch * len(program) - 1e-12
    assert base.iteration_time < priced.iteration_time <= (
        base.iteration_time + dispatch * sum(map(len, two.programs)) + 1e-12)
