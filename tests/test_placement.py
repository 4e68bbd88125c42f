"""The optimizer's placement as one value: read once from the flags, checked once, priced
by the memory model and the planner; and a new placement added in three places only."""

from dataclasses import dataclass, fields, replace

import pytest

from megatron.config.errors import ConfigError
from megatron.config.placement import (
    ON_HOST,
    AutoSplit,
    DeviceShare,
    Interleaved,
    Placement,
    Resident,
    StateStorage,
)
from megatron.planning import evaluate as plan_evaluate
from megatron.schedules.cost_model import backward_stage_params
from megatron.schedules.placement_cost import RankOptimizer, device_optimizer_bytes
from megatron.training.arguments import parse_args

TINY = ["--plan", "--model-preset", "tiny", "--global-batch-size", "8"]


@pytest.mark.parametrize("flags,expected", [
    ([], Placement()),
    (["--optimizer-gpu-stride", "3"], Placement(Interleaved(3))),
    (["--optimizer-gpu-stride", "device:4", "--optimizer-subgroup-size", "4096"],
     Placement(Interleaved(-4), subgroup_size=4096)),
    (["--optimizer-gpu-stride", "auto"], Placement(AutoSplit())),
    (["--optimizer-gpu-resident-fraction", "0.25"], Placement(Resident(0.25))),
    (["--optimizer-state-location", "nvme"], Placement(states=StateStorage(on_nvme=True))),
])
def test_the_flags_become_one_value_and_back(flags, expected):
    c = parse_args([*TINY, *flags]).cpu_optimizer
    assert c.placement == expected
    assert c.placement is c.placement  # read once per configuration
    assert expected.flags() == {f: getattr(c, f) for f in expected.flags()}
    assert {f.name for f in fields(c)} >= set(expected.flags())


@pytest.mark.parametrize("flags,named", [
    (["--optimizer-gpu-resident-fraction", "1.5"], "--optimizer-gpu-resident-fraction 1.5"),
    (["--optimizer-gpu-resident-fraction", "0.5", "--optimizer-gpu-stride", "2"],
     "--optimizer-gpu-resident-fraction 0.5"),
    (["--optimizer-subgroup-size", "0"], "--optimizer-subgroup-size 0"),
    (["--optimizer-gpu-stride", "device:1"], "--optimizer-gpu-stride"),
])
def test_a_bad_placement_is_one_line_naming_the_flag_and_exit_2(flags, named, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args([*TINY, *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


# A placement added the way the module docstring of megatron/config/placement.py says: the
# value (here, in a test), its pricing (registered below); its execution would be a case in
# the pipeline's assembly. Nothing else changes: the checks, the memory model and the
# planner take it as they are.
@dataclass(frozen=True)
class HalfResident(DeviceShare):
    """Half of every owned stage's fp32 p, m, v kept on the device (never on NVMe)."""

    def check(self, placement: Placement) -> None:
        if placement.states.on_nvme:
            raise ConfigError("--optimizer-state-location", "nvme", "host with HalfResident")


@device_optimizer_bytes.register
def _(updates: HalfResident, rank: RankOptimizer) -> int:
    return 16 * (rank.owned_params // 2)


def test_a_new_placement_is_checked_by_its_value_and_priced_by_the_planner():
    assert Placement(HalfResident()).uses_device
    with pytest.raises(ConfigError, match="host with HalfResident"):
        Placement(HalfResident(), StateStorage(on_nvme=True))
    run = parse_args([*TINY, "--hardware", "h100-sxm"])
    hardware = plan_evaluate.plan_hardware(run)
    plain = plan_evaluate.base_configuration(run)
    assert plain.updates == ON_HOST
    base = plan_evaluate.evaluate(run, plain, hardware, simulate_it=False)
    half = plan_evaluate.evaluate(run, replace(plain, updates=HalfResident()), hardware,
                                  simulate_it=False)
    s = half.schedule
    params = backward_stage_params(run.model, s.partition, s.backward_split)
    for rank, (before, after) in enumerate(zip(base.memory.per_gpu, half.memory.per_gpu)):
        owned = sum(params[b] for b in s.owned_by(rank))
        assert before["optimizer_subgroups"] == 0
        assert after["optimizer_subgroups"] == 16 * (owned // 2) > 0
        assert {k: v for k, v in after.items() if k != "optimizer_subgroups"} == {
            k: v for k, v in before.items() if k != "optimizer_subgroups"}


def test_a_placement_without_pricing_is_refused_by_name():
    @dataclass(frozen=True)
    class Unpriced(DeviceShare):
        pass

    with pytest.raises(TypeError, match="Unpriced"):
        device_optimizer_bytes(Unpriced(), RankOptimizer(1, (), 0, 2, None))
