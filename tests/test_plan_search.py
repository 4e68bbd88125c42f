"""--auto-config's search: its lower bounds hold, and pruning with them changes nothing.

The search sets aside, unbuilt, the shapes whose least memory cannot fit and those whose
lower-bound time is above the fifth fastest found; the fastest five must then be exactly
those of simulating every configuration (the brute force below).
"""

from dataclasses import replace

import pytest

from megatron.config.placement import ON_HOST, Interleaved, Resident, split_flag
from megatron.config.presets import get_preset
from megatron.planning import evaluate as plan_evaluate
from megatron.planning import search as plan
from megatron.schedules.cost_model import (
    DeviceUpdateCosts,
    backward_stage_params,
    derived_costs,
    iteration_lower_bound,
    model_partition,
)
from megatron.schedules.generators import SCHEDULE_NAMES, build_schedule, schedule_kind
from megatron.schedules.hardware import get_hardware, update_rates
from megatron.schedules.lowering import SYNCHRONOUS_OPTIMIZER
from megatron.schedules.memory_model import (
    GPU_TERMS,
    NODE_TERMS,
    MemoryShape,
    plan_memory,
    shape_report,
)
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.optimizer_stride import auto_split
from megatron.schedules.simulator import simulate
from megatron.schedules.validator import validate
from megatron.training.arguments import parse_args

SHAPES = [("gpipe", 4, 4, 1), ("1f1b", 4, 4, 1), ("interleaved-1f1b", 4, 8, 1),
          ("mobius", 4, 8, 1), ("decoupled", 4, 8, 2), ("decoupled", 2, 4, 3),
          ("decoupled", 4, 4, 1)]


def test_the_shapes_cover_every_schedule():
    assert {shape[0] for shape in SHAPES} == set(SCHEDULE_NAMES)


def _built(name, ranks, stages, split, micro_batches=8, preset="10b"):
    model = get_preset(preset)
    partition = model_partition(model, stages, min_layers=split)
    return model, build_schedule(name, ranks, stages, split, micro_batches, partition)


@pytest.mark.parametrize("name,ranks,stages,split", SHAPES)
@pytest.mark.parametrize("hardware", ["paper-v100", "h100-sxm"])
def test_iteration_lower_bound_holds_for_every_schedule(name, ranks, stages, split, hardware):
    model, schedule = _built(name, ranks, stages, split)
    costs = derived_costs(schedule, model, hardware, micro_batch_size=2, seq_length=2048)
    report = validate(schedule)
    synchronous = schedule_kind(name).optimizer_mode == SYNCHRONOUS_OPTIMIZER
    result = simulate(schedule, costs, report)
    bound = iteration_lower_bound(schedule, costs, steps_after_all_compute=synchronous)
    assert max(result.busy) < bound <= result.iteration_time * (1 + 1e-9)
    # with device subgroups every k-th, the CPU keeps 1 - 1/k of each update
    rates = update_rates(get_hardware(hardware))
    stride = 2
    placed = place_device_subgroups(schedule, report=report)
    priced = replace(costs, device_update=DeviceUpdateCosts(
        stride, backward_stage_params(model, schedule.partition, split), rates))
    strided = simulate(placed, priced, report).iteration_time
    assert iteration_lower_bound(schedule, costs, cpu_share=1 - 1 / stride,
                                 steps_after_all_compute=synchronous) <= strided * (1 + 1e-9)


@pytest.mark.parametrize("name,ranks,stages,split", SHAPES)
def test_placing_device_subgroups_keeps_the_validation(name, ranks, stages, split):
    _, schedule = _built(name, ranks, stages, split)
    report = validate(schedule)
    assert validate(place_device_subgroups(schedule, report=report)) == report


@pytest.mark.parametrize("name,ranks,stages,split", SHAPES)
def test_shape_memory_is_a_lower_bound_of_every_term(name, ranks, stages, split):
    model, schedule = _built(name, ranks, stages, split)
    shape = build_schedule(name, ranks, stages, split, 8, schedule.partition, lower=False)
    assert shape.programs == ()
    full = plan_memory(schedule, MemoryShape(model, 2, 2048, 2, 4, procs_per_node=2))
    least = plan_memory(shape, MemoryShape(model, 2, 2048, 2, 4, procs_per_node=2),
                        report=shape_report(shape))
    # slots, checkpoints, activations and operator working memory are one figure, taken at
    # the moment it peaks
    together = ("parameter_slots", "activation_checkpoints", "activations", "operator_working")
    for low, high in zip(least.per_gpu, full.per_gpu):
        assert all(low[t] <= high[t] for t in GPU_TERMS if t not in together)
        assert sum(low[t] for t in together) <= sum(high[t] for t in together)
    for low, high in zip(least.per_node, full.per_node):
        assert all(low[t] <= high[t] for t in NODE_TERMS)
    assert sum(least.gpu_total(r) for r in range(ranks)) > 0


def _run(*extra):
    return parse_args(["--plan", "--auto-config", "--model-preset", "10b", "--num-layers", "12",
                       "--bf16", "--gpus-per-node", "4", "--micro-batch-size", "2",
                       "--seq-length", "1024", "--global-batch-size", "16", *extra])


def _brute_force(run, hardware):
    """Every shape built, checked and simulated with every stride: what fits, fastest first."""
    shares = plan.searched_updates(run, hardware)
    found = [e for config in plan.searched_configurations(run, hardware)
             for e in plan.evaluate_shape((run, config, shares, hardware))]
    return sorted(found, key=plan.rank_key)


@pytest.mark.parametrize("hardware", ["paper-v100", "h100-sxm"])
def test_search_finds_what_simulating_everything_finds(hardware):
    run = _run("--hardware", hardware)
    profile = plan_evaluate.plan_hardware(run)
    result = plan.search(run, profile)
    brute = _brute_force(run, profile)
    top = [(e.config, e.simulation.iteration_time) for e in result.ranked[:plan.SEARCH_TOP]]
    assert top == [(e.config, e.simulation.iteration_time) for e in brute[:plan.SEARCH_TOP]]
    # and those are what evaluating each configuration on its own predicts
    for config, time in top:
        assert plan_evaluate.evaluate(run, config, profile).simulation.iteration_time == pytest.approx(
            time, rel=1e-12)
    assert result.cannot_fit + result.cannot_win > 0  # the bounds did set work aside
    assert result.built + result.cannot_fit + result.cannot_win == result.configurations


def test_the_search_compares_the_optimizer_gpu_stride_of_eq1():
    run = _run("--hardware", "paper-v100")
    profile = plan_evaluate.plan_hardware(run)
    # Eq. 1 over the profile's rates (its CPU rate fitted to the paper's runs, 0.5e9
    # parameters/s per GPU): about two thirds of the subgroups on the device
    split = auto_split(update_rates(profile)).split
    assert split == -3
    assert plan.searched_updates(run, profile) == (ON_HOST, Interleaved(split))
    ranked = plan.search(run, profile).ranked
    chosen, _ = plan.auto_configure(run, profile)
    # exposed updates are where the V100 node loses
    assert chosen.cpu_optimizer.optimizer_gpu_stride == split
    assert f"--optimizer-gpu-stride {split_flag(split)}" in ranked[0].config.flags()
    # a stride is offered only where it is predicted faster than the CPU alone
    plain = plan_evaluate.evaluate(run, replace(ranked[0].config, updates=ON_HOST), profile)
    assert ranked[0].simulation.iteration_time < plain.simulation.iteration_time
    # a profile without the device's update rate cannot price the device path: not searched
    no_rate = replace(profile, gpu_update_params_per_s=0.0)
    assert plan.searched_updates(run, no_rate) == (ON_HOST,)
    assert plan.searched_updates(_run("--hardware", "paper-v100",
                                      "--optimizer-gpu-resident-fraction", "0.5"),
                                 profile) == (Resident(0.5),)
