"""Measured hardware profiles as --plan reads them: MFU against the datasheet peak, the
compute curve fitted over several micro-batches, and the layer the profile measured."""

import dataclasses
import json

import pytest

from megatron.config.presets import get_preset
from megatron.schedules.hardware import (
    fit_efficiency_curve,
    get_hardware,
    layer_shape,
    shape_differences,
)
from megatron.training.training import main

# a small plan: seconds of simulation, no training
TINY_PLAN = ["--plan", "--json", "--model-preset", "tiny", "--gpus-per-node", "2",
             "--global-batch-size", "8"]


def _plan(capsys, tmp_path, json_out=True, model=("--model-preset", "tiny"), **fields):
    """--plan with a measured-like profile: paper-v100's with `fields` changed."""
    profile = dataclasses.replace(get_hardware("paper-v100"), name="measured", **fields)
    path = tmp_path / "measured.json"
    path.write_text(profile.to_json())
    argv = [a for a in TINY_PLAN if json_out or a != "--json"]
    argv[argv.index("--model-preset"):argv.index("--model-preset") + 2] = list(model)
    code = main([*argv, "--hardware", str(path)])
    out = capsys.readouterr().out
    return code, (json.loads(out) if json_out else out)


def test_fit_recovers_the_cost_models_curve_from_several_micro_batches():
    peak, half = 40e9, 300.0
    points = {t: peak * t / (t + half) for t in (128, 512, 1024)}
    fitted_peak, fitted_half = fit_efficiency_curve(points)
    assert fitted_peak == pytest.approx(peak, rel=1e-9)
    assert fitted_half == pytest.approx(half, rel=1e-9)
    # a rate that does not grow with the tokens: no curve, its harmonic mean
    assert fit_efficiency_curve({128: 10e9, 512: 10e9, 1024: 10e9}) == (
        pytest.approx(10e9), 0.0)


def test_mfu_is_against_the_datasheet_peak_when_the_profile_has_it(capsys, tmp_path):
    """A measured profile's peak is its own fitted rate: MFU against it is near 1 whatever
    the GPU does (the H100 plan said 'MFU 0.989'). With the datasheet peak MFU divides by
    that; without one, the plan says MFU is against the measured rate."""
    measured_rate = 30e12
    _, with_sheet = _plan(capsys, tmp_path, gpu_peak_flops=measured_rate,
                          gpu_max_efficiency=1.0, datasheet_peak_flops=112e12)
    _, without = _plan(capsys, tmp_path, gpu_peak_flops=measured_rate,
                       gpu_max_efficiency=1.0, datasheet_peak_flops=None)
    c, d = with_sheet["configuration"], without["configuration"]
    assert c["predicted_iteration_s"] == d["predicted_iteration_s"]  # same times priced
    assert with_sheet["mfu_against"] == "datasheet peak"
    assert without["mfu_against"] == "measured peak rate"
    assert c["mfu"] == pytest.approx(d["mfu"] * measured_rate / 112e12, rel=1e-12)
    _, text = _plan(capsys, tmp_path, json_out=False, gpu_peak_flops=measured_rate,
                    datasheet_peak_flops=None)
    assert "MFU is against the profile's measured peak rate (30 TFLOP/s per GPU)" in text


def test_plan_names_the_layer_fields_a_profile_measured_differently(capsys, tmp_path):
    tiny, small = get_preset("tiny"), get_preset("small")
    measured = get_hardware("paper-v100")
    assert shape_differences(measured, small) == []  # a built-in profile measured no layer
    measured = dataclasses.replace(measured, compute_shape=layer_shape(tiny))
    assert shape_differences(measured, tiny) == []
    assert "hidden_size 128 -> 512" in shape_differences(measured, small)
    unfused = dataclasses.replace(tiny, attention_backend="unfused")
    assert shape_differences(measured, unfused) == ["attention_scores False -> True"]
    _, same = _plan(capsys, tmp_path, compute_shape=layer_shape(tiny))
    _, other = _plan(capsys, tmp_path, model=("--model-preset", "small"),
                     compute_shape=layer_shape(tiny))
    assert same["compute_shape_differences"] == []
    assert "seq_length 128 -> 256" in other["compute_shape_differences"]
