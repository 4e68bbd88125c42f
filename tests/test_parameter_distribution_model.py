"""The simulated cost of moving parameters between nodes: blocking after the step against
per stage while the next iteration runs, checked against what the plan implies by hand."""

import json

import pytest

from megatron.config.presets import get_preset
from megatron.schedules.cost_model import derived_costs, model_partition, uniform_costs
from megatron.schedules.distribution import simulate_distribution
from megatron.schedules.generators import build_schedule
from megatron.schedules.replica_plan import node_of, plan_replicas
from tools.simulate_pipeline import main as simulate_cli


def two_rank_decoupled(inter_node_time=0.5, forward_time=1.0):
    schedule = build_schedule("decoupled", 2, 4, 2, 4, [2, 2, 2, 2])
    return schedule, uniform_costs(schedule, forward_time=forward_time,
                                   inter_node_time=inter_node_time)


def test_blocking_on_two_nodes_exposes_every_push_one_after_the_other():
    """Two nodes share one link pair and every push involves both walks: the next
    iteration waits for all of them, back to back."""
    schedule, costs = two_rank_decoupled()
    result = simulate_distribution(schedule, costs, 1, "blocking")
    pushes = plan_replicas(schedule, 1)
    expected = sum(costs.inter_node_transfer[r.backward_stage] for r in pushes)
    assert len(result.transfers) == len(pushes) > 0
    assert result.link_time == pytest.approx(expected)
    assert result.exposed_time == pytest.approx(expected)


def test_per_stage_exposes_only_what_the_first_forward_waits_for():
    """Rank 0 starts the next iteration with forward stage 0, whose backward stage (0, 0) is
    owned on the other node and pushed first; the other pushes arrive while the GPUs work."""
    schedule, costs = two_rank_decoupled()
    result = simulate_distribution(schedule, costs, 1, "per-stage")
    first = plan_replicas(schedule, 1)[0]
    assert first.backward_stage == (0, 0) and first.holders == (0,)
    assert result.exposed_time == pytest.approx(costs.inter_node_transfer[(0, 0)])
    blocking = simulate_distribution(schedule, costs, 1, "blocking")
    assert result.exposed_time < blocking.exposed_time


def test_a_push_never_starts_before_the_previous_one_on_its_links():
    schedule = build_schedule("decoupled", 4, 8, 2, 8)
    costs = uniform_costs(schedule, inter_node_time=0.3)
    result = simulate_distribution(schedule, costs, 2, "per-stage")
    by_node: dict[int, list] = {}
    for push in result.transfers:
        by_node.setdefault(node_of(push.rank, 2), []).append(push)
    for pushes in by_node.values():
        for before, after in zip(pushes, pushes[1:]):
            assert after.start >= before.end - 1e-12


def test_one_node_moves_nothing():
    schedule, costs = two_rank_decoupled()
    for mode in ("blocking", "per-stage"):
        result = simulate_distribution(schedule, costs, 2, mode)
        assert result.transfers == () and result.exposed_time == 0.0


def test_bad_mode_and_unpriced_link_are_refused():
    schedule, costs = two_rank_decoupled(inter_node_time=0.0)
    with pytest.raises(ValueError, match="mode='async'"):
        simulate_distribution(schedule, costs, 1, "async")
    with pytest.raises(ValueError, match="inter-node link"):
        simulate_distribution(schedule, costs, 1, "per-stage")


def test_derived_costs_price_a_stage_at_its_16_bit_bytes_over_the_link():
    preset = get_preset("10b")
    schedule = build_schedule("decoupled", 8, 16, 2, 16,
                              model_partition(preset, 16, 1024, min_layers=2))
    costs = derived_costs(schedule, preset, "paper-v100", 2, 1024)
    # paper-v100: 200 Gb/s HDR per node; the transfer is as long as the PCIe copy scaled
    # by the bandwidths (both move the same 16-bit bytes).
    for b, seconds in costs.inter_node_transfer.items():
        assert seconds == pytest.approx(costs.param_transfer[b] * 12e9 / 25e9)


def test_the_cli_reports_both_modes(capsys):
    assert simulate_cli(["--schedule", "decoupled", "--ranks", "2", "--forward-stages", "4",
                         "--backward-split", "2", "--micro-batches", "4",
                         "--inter-node-time", "0.5", "--procs-per-node", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["parameter_distribution"]
    assert [r["mode"] for r in rows] == ["blocking", "per-stage"]
    assert rows[1]["exposed_time"] < rows[0]["exposed_time"]
