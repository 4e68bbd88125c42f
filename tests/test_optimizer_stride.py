"""The optimizer-stride model (Eq. 1 of Deep Optimizer States), its tool and the
start-up calibration of its throughputs."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.config.placement import parse_gpu_stride, split_flag
from megatron.offload.device import CPU_DEVICE_MEMORY_ENV, DeviceLayer
from megatron.pipeline.optimizer_calibration import (
    calibrated_update_rates,
    measure_update_rates,
)
from megatron.schedules.hardware import get_hardware, update_rates
from megatron.schedules.optimizer_stride import (
    REFERENCE_NUMEL,
    REFERENCE_SUBGROUP,
    UpdateRates,
    auto_split,
    device_share,
    gpu_update_stride,
    interleaved_update_time,
    is_device_subgroup,
)
from megatron.schedules.subgroup_memory import subgroup_slots_bytes
from megatron.training.training import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V100 = UpdateRates(3e9, 35e9, 2e9, 8.7e9)  # the paper's 4x V100 machine: k = 2


def test_eq1_on_the_papers_worked_example():
    model = gpu_update_stride(V100)
    # (3/3 + 1/35) / (1/2 + 1/8.7 - 1/6), in units of 1e-9 s per parameter
    assert model.k_real == pytest.approx((1 + 1 / 35) / (1 / 2 + 1 / 8.7 - 1 / 6), rel=1e-12)
    assert model.k == 2
    # S cancels: the balance of Eq. 1 holds for the exact k and any subgroup size
    for s in (1e6, 1e8):
        k = model.k_real
        cpu = k * (s / 2e9 + s / 8.7e9)
        device = max(3 * s / 3e9, 3 * s / 3e9 + k * s / (2 * 3e9)) + s / 35e9
        assert cpu == pytest.approx(device, rel=1e-12)
    # Algorithm 1: every k-th subgroup (0-based i with (i + 1) % k == 0)
    assert [i for i in range(8) if is_device_subgroup(i, 2)] == [1, 3, 5, 7]
    assert not any(is_device_subgroup(i, 0) for i in range(8))


def test_the_best_stride_of_the_timing_model_is_next_to_eq1s_k():
    k_real = gpu_update_stride(V100).k_real
    times = {k: interleaved_update_time(10**9, 10**7, k, V100) for k in (0, 2, 3, 4, 5, 6)}
    best = min((k for k in times if k), key=times.get)
    assert best in (int(k_real), int(k_real) + 1)
    assert all(times[k] < times[0] for k in times if k)
    # a CPU as fast as half a copy: nothing goes to the device
    assert gpu_update_stride(UpdateRates(1e9, 1e12, 1e12, 1e12)).k == 0


def test_the_tool_prints_k_and_refuses_a_bad_rate():
    tool = [sys.executable, os.path.join(ROOT, "tools", "optimizer_stride.py")]
    rates = ["--h2d-params-per-s", "3e9", "--gpu-update-params-per-s", "35e9",
             "--cpu-update-params-per-s", "2e9", "--downscale-params-per-s", "8.7e9"]
    out = subprocess.run([*tool, *rates, "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["k"] == 2 and result["numerator"] == pytest.approx(1e-9 + 1 / 35e9)
    bad = subprocess.run([*tool, *rates[:-1], "-1"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "--downscale-params-per-s: -1.0 must be a finite number > 0")


def test_calibration_is_quick_and_cached_per_machine(tmp_path):
    lines = []
    # under the stream sanitizer, as training with --device-sanitizer calibrates: a
    # subgroup's load that reads what the one before it still flushes is a race
    with DeviceLayer("cpu", sanitize=True) as device:
        # at a run's subgroup size of 2^17 (the default measures 2^19)
        first = calibrated_update_rates(device, threads=1, cache_dir=str(tmp_path),
                                        log=lines.append, subgroup=1 << 17)
        second = calibrated_update_rates(device, threads=1, cache_dir=str(tmp_path),
                                         log=lines.append)
    assert first == second
    assert "measured in" in lines[0] and "cached in" in lines[1] and "measured" not in lines[1]
    assert len(list(tmp_path.iterdir())) == 1
    for rate in (first.h2d_params_per_s, first.gpu_update_params_per_s,
                 first.cpu_update_params_per_s, first.downscale_params_per_s):
        assert rate > 1e6  # params/s: any machine updates a million parameters a second
    # the mechanism's figures: a share, a fixed cost per subgroup under 50 ms, a throughput
    assert 0.0 <= first.overlap <= 1.0 and 0.0 <= first.subgroup_overhead_s < 0.05
    assert first.device_subgroup_params_per_s > 1e5
    assert "device subgroups" in lines[0] and "overlapping the CPU's" in lines[0]


def test_calibration_fits_in_the_device_memory_of_the_subgroups_it_prices(monkeypatch):
    """A first run calibrates where its subgroups are squeezed: measured with that subgroup
    size, the calibration holds no more device memory than their two slots."""
    size = 8192
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, str(subgroup_slots_bytes(size, 4)))
    with DeviceLayer("cpu") as device:
        rates = measure_update_rates(device, threads=1, numel=size)
        assert device.device_bytes == 0  # all given back
    assert rates.device_subgroup_params_per_s > 0
    with DeviceLayer("cpu") as device, pytest.raises(torch.OutOfMemoryError):
        measure_update_rates(device, threads=1, numel=2 * size)  # the check that bounds it


@pytest.mark.parametrize("profile", ["paper-v100", "h100-sxm", "dgx-h100"])
def test_the_device_share_balances_both_sides_where_k_is_below_1(profile):
    """On the built-in profiles Eq. 1 gives k < 1: the balance puts most subgroups on the
    device, which the stride (clamped to 2: half of them) cannot express. The tool reports
    that share; at it, the CPU's time per parameter equals the device's."""
    rates = update_rates(get_hardware(profile))
    tool = [sys.executable, os.path.join(ROOT, "tools", "optimizer_stride.py"),
            "--h2d-params-per-s", repr(rates.h2d_params_per_s),
            "--gpu-update-params-per-s", repr(rates.gpu_update_params_per_s),
            "--cpu-update-params-per-s", repr(rates.cpu_update_params_per_s),
            "--downscale-params-per-s", repr(rates.downscale_params_per_s), "--json"]
    out = json.loads(subprocess.run(tool, capture_output=True, text=True, check=True).stdout)
    share, b = out["device_share"], rates.h2d_params_per_s
    assert out["k_real"] < 1 and out["k"] == 2 and out["device_share_at_k"] == 0.5
    # the placement auto takes: the GPU-heavy split next to the balance, predicted faster
    # (paper-v100's CPU rate, fitted to the paper's runs, is 0.5e9 parameters/s per GPU:
    # as on h100-sxm, about two thirds of the subgroups belong on the device)
    placement = out["placement"]
    assert placement["flag"] == {"paper-v100": "device:3", "h100-sxm": "device:3",
                                 "dgx-h100": "device:5"}[profile]
    assert placement["predicted_s"][placement["flag"]] == min(placement["predicted_s"].values())
    if placement["flag"] != "2":
        assert placement["predicted_s"][placement["flag"]] < placement["predicted_s"]["2"]
    assert abs(placement["device_share"] - out["device_share"]) < 0.1
    assert 0.5 < share < 1
    cpu = (1 - share) * (1 / rates.cpu_update_params_per_s + 1 / rates.downscale_params_per_s)
    device = share * (3 / b + 1 / rates.gpu_update_params_per_s) + (1 - share) / (2 * b)
    assert cpu == pytest.approx(device, rel=1e-12)
    # per parameter, with a share s on the device (Eq. 1's terms): the balance is the best s,
    # and beats the half that the stride 2 places
    c = 1 / rates.cpu_update_params_per_s + 1 / rates.downscale_params_per_s
    d = 3 / b + 1 / rates.gpu_update_params_per_s

    def per_param(s):
        return max((1 - s) * c, s * d + (1 - s) / (2 * b))

    assert all(per_param(share) <= per_param(s / 100) for s in range(101))
    assert per_param(share) < per_param(0.5)
    # and the half is what the runtime's timing model gives the stride 2
    whole, subgroup = 10**9, 10**7
    assert interleaved_update_time(whole, subgroup, 2, rates) == pytest.approx(
        whole * per_param(0.5) + subgroup * 3 / b, rel=1e-9)


def test_the_device_share_of_the_papers_example_is_below_half():
    model = gpu_update_stride(V100)  # k_real 2.29: 2.29 subgroups on the CPU for each on the device
    assert model.device_share == pytest.approx(1 / (1 + model.k_real), rel=1e-12)
    assert model.device_share < 1 / model.k  # the stride 2 puts more there than Eq. 1 asks


def test_the_split_spells_strides_and_gpu_heavy_placements():
    """K > 0: every K-th subgroup on the device; -N (flag device:N): all but every N-th."""
    assert [i for i in range(6) if is_device_subgroup(i, -3)] == [0, 1, 3, 4]
    assert [device_share(s) for s in (0, 2, 4, -2, -3)] == pytest.approx([0, 0.5, 0.25, 0.5, 2 / 3])
    for text, split in (("auto", None), ("0", 0), ("3", 3), ("device:3", -3)):
        assert parse_gpu_stride(text) == split
        if split is not None:
            assert split_flag(split) == text
    for bad in ("device:1", "device:x", "-3", "x", "device:"):
        with pytest.raises(ValueError, match="device:N with N >= 2"):
            parse_gpu_stride(bad)
    # the timing model counts a partial last subgroup at its size: of 35 in subgroups of
    # 10, device:3 puts 10 + 10 + 5 on the device, 10 on the CPU (all rates 1 per second)
    rates = UpdateRates(1.0, 1.0, 1.0, 1.0)
    assert interleaved_update_time(35, 10, -3, rates) == pytest.approx(
        max(10 * 2.0, 25 * 4.0 + 10 / 2.0) + 30.0)


def _predicted(rates, split):
    return interleaved_update_time(REFERENCE_NUMEL, REFERENCE_SUBGROUP, split, rates)


def test_eq1_below_1_chooses_the_gpu_heavy_split_faster_than_the_stride():
    """h100-sxm: k_real 0.48, the balance puts 67% on the device; device:3 (2 of 3 there)
    is predicted about a third faster than the stride 2 and beats device:4; auto takes it."""
    rates = update_rates(get_hardware("h100-sxm"))
    choice = auto_split(rates)
    assert choice.model.k_real == pytest.approx(0.4847, abs=1e-4) and choice.model.k == 2
    assert choice.split == -3
    assert set(choice.predicted_s) == {0, 2, -3, -4}
    assert choice.predicted_s[-3] == _predicted(rates, -3)
    assert choice.predicted_s[-3] < choice.predicted_s[-4] < choice.predicted_s[2]
    assert choice.predicted_s[-3] < 0.7 * choice.predicted_s[2]
    # no stride, no other GPU-heavy split, does better
    assert all(choice.predicted_s[-3] <= _predicted(rates, s) for s in (1, 3, 4, -2, -5, -6))


def test_eq1_at_1_keeps_the_stride_2():
    """k_real = 1: one on the CPU per one on the device, the half that the stride 2 gives
    (device:2 gives the same half: a tie keeps the stride)."""
    rates = UpdateRates(4.0, 4.0, 1.0, 8.0)  # 3/B + 1/Ug = 1 = 1/Uc + 1/Dc - 1/(2B)
    choice = auto_split(rates)
    assert choice.model.k_real == pytest.approx(1.0, rel=1e-12)
    assert choice.split == 2
    assert all(choice.predicted_s[2] <= _predicted(rates, s) for s in (0, 3, -2, -3))


def test_eq1_above_1_keeps_the_stride():
    """The paper's worked example: k_real 2.29, the stride k = 2; no GPU-heavy split is
    weighed, and each is predicted slower than the stride (the device is the slow side)."""
    choice = auto_split(V100)
    assert choice.model.k_real > 2 and choice.split == 2 and set(choice.predicted_s) == {0, 2}
    assert all(choice.predicted_s[2] < _predicted(V100, s) for s in (0, -3, -4))


def test_auto_falls_back_to_the_cpu_where_its_layout_is_not_faster():
    """Subgroups cut to what the device memory holds: at the paper's rates Eq. 1 still says
    k = 2, but with 2 subgroups of a stage the device one's flush is exposed whole (the
    tail): the device split is predicted slower than all on the CPU, and auto keeps 0."""
    numel = 10**8
    assert auto_split(V100, numel, numel // 100).split == 2  # small subgroups: the stride
    choice = auto_split(V100, numel, numel // 2)
    assert choice.split == 0
    assert choice.predicted_s[0] <= choice.predicted_s[2]


def test_auto_never_loses_to_stride_0_where_the_gpu_cannot_hold_its_subgroups(tmp_path, capsys):
    """--plan with a GPU that holds stride 0's plan with no room, then 10 MiB of room, beside
    it: the split Eq. 1 gives at the reference layout (what auto used to take, its slots
    sized to the gradient buffers) does not fit there; auto, priced with the memory it
    really has, fits and is never predicted slower than stride 0."""
    def plan(profile, stride):
        path = tmp_path / "gpu.json"
        path.write_text(profile.to_json())
        code = main(["--plan", "--json", "--model-preset", "small", "--gpus-per-node", "1",
                     "--global-batch-size", "16", "--bf16", "--hardware", str(path),
                     "--optimizer-gpu-stride", stride])
        out = json.loads(capsys.readouterr().out)
        return code, out

    roomy = dataclasses.replace(get_hardware("h100-sxm"), gpus_per_node=1)
    _, plain = plan(roomy, "0")
    used = sum(v for k, v in plain["per_gpu"][0].items() if k != "rank")
    reference_split = split_flag(auto_split(update_rates(roomy)).split)
    for room, device_split_fits in ((0, False), (10 * 2**20, True)):
        tight = dataclasses.replace(roomy, gpu_memory_bytes=roomy.gpu_reserved_bytes + used + room)
        zero_code, zero = plan(tight, "0")
        auto_code, auto = plan(tight, "auto")
        old_code, _ = plan(tight, reference_split)
        assert zero_code == auto_code == 0 and old_code == 3
        assert (auto["configuration"]["predicted_iteration_s"]
                <= zero["configuration"]["predicted_iteration_s"])
        assert (auto["configuration"]["optimizer_gpu_stride"] != 0) == device_split_fits


def test_plan_prices_auto_with_the_mechanism_the_profile_measured(tmp_path, capsys):
    """A profile carries the subgroups' mechanism as tools/profile_hardware.py measures it:
    update_rates passes it on, and --plan's auto, which took a device split on the profile
    with Eq. 1's assumptions, takes stride 0 when the mechanism is as slow as the CPU layer's
    (2e7 parameters/s, 0.5 ms a subgroup, no overlap): the runtime's choice. A value out of
    range is refused when the profile loads."""
    def auto_stride(profile):
        path = tmp_path / "gpu.json"
        path.write_text(profile.to_json())
        assert main(["--plan", "--json", "--model-preset", "small", "--gpus-per-node", "1",
                     "--global-batch-size", "16", "--bf16", "--hardware", str(path),
                     "--optimizer-gpu-stride", "auto"]) == 0
        return json.loads(capsys.readouterr().out)["configuration"]["optimizer_gpu_stride"]

    assumed = dataclasses.replace(get_hardware("h100-sxm"), gpus_per_node=1)
    slow = dataclasses.replace(assumed, device_subgroup_params_per_s=2e7,
                               subgroup_overhead_s=5e-4, update_overlap=0.0)
    rates = update_rates(slow)
    assert (rates.device_subgroup_params_per_s, rates.subgroup_overhead_s,
            rates.overlap) == (2e7, 5e-4, 0.0)
    assert update_rates(assumed).overlap == 1.0 and update_rates(assumed).subgroup_overhead_s == 0
    assert auto_stride(assumed) != 0
    assert auto_stride(slow) == 0
    for field, bad in (("update_overlap", 1.5), ("subgroup_overhead_s", -1.0),
                       ("device_subgroup_params_per_s", 0.0)):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(assumed, **{field: bad})


# What the CPU device layer measures (params/s): its "device" update in torch ops is
# slower than the C++ kernel per parameter, yet Eq. 1 gives k = 8 from the throughputs.
CPU_LAYER = UpdateRates(1.2e9, 2.5e8, 1.2e9, 2.3e9)


def test_the_timing_model_prices_the_measured_overlap_and_fixed_cost():
    """35 parameters in subgroups of 10, device:3 (10 + 10 + 5 on the device, 10 on the CPU),
    all rates 1/s: CPU side 10 x 2 = 20 s; device side 25 x 4 + 10 / 2 = 105 s plus 1 s for
    each of its 3 subgroups; half of the CPU's 20 s not hidden; the last flush 30 s + 1 s."""
    rates = UpdateRates(1.0, 1.0, 1.0, 1.0, overlap=0.5, subgroup_overhead_s=1.0)
    assert interleaved_update_time(35, 10, -3, rates) == pytest.approx(108 + 10 + 31)
    serial = dataclasses.replace(rates, overlap=0.0, subgroup_overhead_s=0.0)
    assert interleaved_update_time(35, 10, -3, serial) == pytest.approx(20 + 105 + 30)
    # the mechanism measured at 1/8 parameter a second: 25 x 8 + 10 / 2 = 205 s device side
    measured = dataclasses.replace(serial, device_subgroup_params_per_s=0.125)
    assert interleaved_update_time(35, 10, -3, measured) == pytest.approx(20 + 205 + 30)
    for bad in ({"overlap": 1.5}, {"overlap": -0.1}, {"subgroup_overhead_s": -1.0},
                {"subgroup_overhead_s": float("inf")}, {"device_subgroup_params_per_s": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(rates, **bad)


@pytest.mark.parametrize("subgroup", [4096, 10**5])
def test_auto_keeps_stride_0_where_the_device_side_runs_on_the_kernels_cores(subgroup):
    """Eq. 1's assumption (the two sides overlap) makes the CPU layer's slower "device"
    worth a stride; measured, they do not overlap (overlap 0): every split then costs its
    device time on top of the CPU's, and auto keeps everything on the CPU at any layout."""
    assert gpu_update_stride(CPU_LAYER).k == 8
    assert auto_split(CPU_LAYER, 10**8, subgroup).split == 8  # as Eq. 1 assumes
    measured = dataclasses.replace(CPU_LAYER, overlap=0.0)
    choice = auto_split(measured, 10**8, subgroup)
    assert choice.split == 0 and choice.predicted_s[0] < choice.predicted_s[8]
    # all on the CPU: the kernel, the downscale, the 16-bit copies (1/(2B) each) not hidden
    assert choice.predicted_s[0] == pytest.approx(10**8 * (1 / 1.2e9 + 1 / 2.3e9 + 1 / 2.4e9))
    # the mechanism as the CPU layer measures it (its streams beside the kernel's thread
    # overlap in part, but it moves 2e7 parameters a second): no split either
    chain = dataclasses.replace(CPU_LAYER, overlap=0.6, device_subgroup_params_per_s=2e7)
    assert auto_split(chain, 10**8, subgroup).split == 0


def test_a_fixed_cost_per_subgroup_keeps_small_subgroups_on_the_cpu():
    """The paper's rates (k = 2, a GPU beside the cores) with 10 us per device subgroup,
    100M parameters: in subgroups of 1M the split still wins; squeezed to 10K (what a full
    GPU leaves), 5000 device subgroups cost 50 ms, more than the split saves, and auto keeps
    stride 0, where the model without the fixed cost took the stride."""
    rates = dataclasses.replace(V100, subgroup_overhead_s=1e-5)
    assert auto_split(rates, 10**8, 10**6).split == 2
    squeezed = auto_split(rates, 10**8, 10**4)
    assert squeezed.split == 0
    without = auto_split(V100, 10**8, 10**4)
    assert without.split == 2
    assert squeezed.predicted_s[2] == pytest.approx(without.predicted_s[2] + 5001 * 1e-5)


def test_auto_is_never_predicted_slower_than_stride_0():
    """Over throughputs either side of the balance, overlaps and fixed costs, layouts from
    squeezed to whole: auto's split is the fastest it weighed, 0 among them."""
    for b, ug in ((3e9, 35e9), (1.2e9, 2.5e8), (2.5e10, 1e11)):
        for uc in (5e8, 2e9, 1e10):
            for overlap in (0.0, 0.4, 1.0):
                for overhead in (0.0, 1e-5, 1e-3):
                    rates = UpdateRates(b, ug, uc, 8.7e9, overlap, overhead,
                                        None if overlap else b / 4)
                    for subgroup in (10**5, 10**7, 10**8):
                        choice = auto_split(rates, 10**8, subgroup)
                        assert 0 in choice.predicted_s
                        assert choice.predicted_s[choice.split] <= choice.predicted_s[0]
                        assert choice.predicted_s[choice.split] == min(
                            choice.predicted_s.values())
