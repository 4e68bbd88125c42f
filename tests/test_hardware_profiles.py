"""Hardware profiles as --plan reads them: MFU against the datasheet peak, the compute
curve fitted over several micro-batches, the layer the profile measured, and every field
checked by its rule when a profile is loaded."""

import dataclasses
import json

import pytest

from megatron.config.model import ModelConfig
from megatron.config.presets import get_preset
from megatron.schedules.cost_model import (
    derived_costs,
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
    megatron_model_flops_per_token,
    model_partition,
)
from megatron.schedules.generators import build_schedule
from megatron.schedules.hardware import (
    FIELD_RULES,
    HardwareProfile,
    ProfileError,
    fit_efficiency_curve,
    get_hardware,
    layer_shape,
    profile_from_dict,
    shape_differences,
)
from megatron.schedules.instructions import BackwardStage
from megatron.training.training import main
from tools.profile_hardware import head_over_layer, with_pass_times
from tools.profile_hardware import main as profile_main

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
    headed = dataclasses.replace(measured, compute_shape={**layer_shape(tiny),
                                                          "vocab_size": 4096})
    assert shape_differences(headed, dataclasses.replace(tiny, vocab_size=4000)) == []
    assert shape_differences(headed, tiny) == ["vocab_size 4096 -> 32000"]


# --- every field checked when a profile is loaded ------------------------------------------

def _profile_file(tmp_path, **fields):
    """dgx-h100's JSON with `fields` changed, as a user's edited copy."""
    values = json.loads(get_hardware("dgx-h100").to_json())
    values.update(fields)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(values))
    return path


def test_every_field_of_a_profile_has_a_rule():
    """A field added to HardwareProfile without a rule fails here (and at import)."""
    names = {f.name for f in dataclasses.fields(HardwareProfile)}
    assert set(FIELD_RULES) == names


def test_a_value_each_rule_refuses_is_refused_in_the_field_it_guards():
    """For every field, a value outside its rule (the wrong type, below its bound, NaN)
    stops the profile with the field's name: no field goes unchecked."""
    base = get_hardware("paper-v100")
    for name, rule in FIELD_RULES.items():
        bad = [3] if rule.kind in (str, dict) else [True, float("nan"), float("inf") * -1]
        if rule.kind in (int, float) and rule.low is not None:
            bad.append(rule.low if rule.above else rule.low - 1)
        if rule.high is not None:
            bad.append(rule.high + 0.5)
        if rule.kind is int:
            bad.append(1.5)
        if not rule.nullable:
            bad.append(None)
        for value in bad:
            with pytest.raises(ProfileError, match=f"^field '{name}' is "):
                dataclasses.replace(base, **{name: value})


@pytest.mark.parametrize("field,value,expected", [
    ("pcie_bytes_per_s", -1.0, "is -1.0; expected bytes per second > 0"),
    ("gpu_peak_flops", -5e12, "is -5000000000000.0; expected FLOP/s > 0"),
    ("host_memory_bytes", -1, "is -1; expected bytes >= 0 (0: unknown)"),
    ("gpus_per_node", 0, "is 0; expected a whole number of GPUs >= 1"),
    ("gpu_max_efficiency", 1.5, "is 1.5; expected a fraction above 0 to 1"),
    ("p2p_bytes_per_s", float("nan"), "is NaN; expected bytes per second > 0"),
    ("cpu_cores", True, "is true; expected a whole number of cores >= 0"),
    ("device_kind", "tpu", 'is "tpu"; expected "cuda" or "cpu"'),
])
def test_a_profile_with_a_meaningless_figure_is_one_line_naming_the_field(
        field, value, expected, tmp_path, capsys):
    path = _profile_file(tmp_path, **{field: value})
    with pytest.raises(SystemExit) as stop:
        main(["--plan", "--model-preset", "tiny", "--hardware", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"pretrain_llama.py: error: --hardware {path}: hardware profile "
                             f"'{path}': field '{field}' {expected}")


def test_zero_stays_unknown_where_a_field_means_it_and_whole_floats_are_counts():
    """h100-host128 has no network figure (0.0) and paper-v100 its calibrated figures:
    both load; 0 for the GPU's memory means unknown; 8.0 GPUs is 8."""
    assert get_hardware("h100-host128").inter_node_bytes_per_s == 0.0
    assert get_hardware("paper-v100").pass_overhead_s == 0.0075  # fitted (its source)
    edited = dataclasses.replace(get_hardware("dgx-h100"), gpu_memory_bytes=0,
                                 gpus_per_node=8.0, memlock_bytes=None)
    assert edited.gpus_per_node == 8 and isinstance(edited.gpus_per_node, int)


def test_a_shape_the_profile_cannot_hold_blames_what_was_given(capsys):
    """The tiny model (4 layers) on dgx-h100's 8 GPUs: the layers are too few for its
    pipeline ranks; no --backward-split was given, so it is not blamed."""
    with pytest.raises(SystemExit) as stop:
        main(["--plan", "--model-preset", "tiny", "--hardware", "dgx-h100"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backward-split" not in err[0]
    assert err[0].startswith("pretrain_llama.py: error: --num-layers 4: needs 1 layers in "
                             "each of 8 forward stages, the model has 4")
    assert "--gpus-per-node" in err[0]
    with pytest.raises(SystemExit):
        main(["--plan", "--model-preset", "tiny", "--hardware", "dgx-h100",
              "--gpus-per-node", "2", "--backward-split", "3"])
    assert "error: --backward-split 3: needs 3 layers" in capsys.readouterr().err


def test_a_profile_brought_up_to_date_prices_a_layer_at_the_passes_just_measured():
    """bench/schedules.py --compute-each-run re-measures a one-layer stage's FORWARD and
    BACKWARD right before a run: the profile it prices that run on must charge a
    decoder layer exactly those (the cost model's own pricing, checked on a profile whose
    curve has a maximum efficiency below 1 and a half-efficiency point), the rest kept."""
    preset = get_preset("tiny")
    measured = dataclasses.replace(get_hardware("paper-v100"), pass_overhead_s=0.0)
    forward_s, backward_s = 0.010, 0.027  # a BACKWARD recomputes its forward
    now = with_pass_times(measured, preset, 4, forward_s, backward_s)
    schedule = build_schedule("decoupled", 2, 4, 1, 2, model_partition(preset, 4))
    costs = derived_costs(schedule, preset, now, micro_batch_size=4)
    layer_only = next(b for b in costs.backward if b.stage == 1)  # no embedding, no head
    assert costs.forward[1] == pytest.approx(forward_s)
    assert costs.backward[layer_only] + costs.recompute[layer_only] == pytest.approx(backward_s)
    assert dataclasses.replace(now, gpu_peak_flops=measured.gpu_peak_flops,
                               backward_over_forward=measured.backward_over_forward) == measured


@pytest.mark.unit
def test_the_executors_compute_over_the_passes_scales_every_priced_pass():
    """A profile's executor_compute_over_pass (tools/profile_hardware.py: a one-layer
    stage's FORWARD and BACKWARD as the executor runs them over the stage's timed alone)
    prices every FORWARD, BACKWARD and recompute, the head's included, at that multiple
    of the passes, and nothing else; bringing the compute up to date (with_pass_times)
    keeps it, and a profile file written without it prices the passes alone."""
    preset = get_preset("tiny")
    measured = with_pass_times(dataclasses.replace(get_hardware("paper-v100"),
                                                   pass_overhead_s=0.0), preset, 4, 0.010, 0.027)
    executor = dataclasses.replace(measured, executor_compute_over_pass=1.2)
    schedule = build_schedule("decoupled", 2, 4, 1, 2, [1, 1, 1, 1])
    alone = derived_costs(schedule, preset, measured, micro_batch_size=4)
    priced = derived_costs(schedule, preset, executor, micro_batch_size=4)
    assert priced.forward == pytest.approx([1.2 * t for t in alone.forward])
    for part in ("backward", "recompute"):
        assert getattr(priced, part) == pytest.approx(
            {b: 1.2 * t for b, t in getattr(alone, part).items()})
    for part in ("optimizer", "param_transfer", "grad_transfer", "p2p_activation",
                 "p2p_checkpoint", "instruction"):
        assert getattr(priced, part) == getattr(alone, part)
    assert with_pass_times(executor, preset, 4, 0.011, 0.030).executor_compute_over_pass == 1.2
    values = json.loads(executor.to_json())
    del values["executor_compute_over_pass"]
    assert derived_costs(schedule, preset, profile_from_dict(values),
                         micro_batch_size=4) == alone


@pytest.mark.unit
def test_a_measured_head_is_priced_at_its_passes_and_scales_by_its_flops():
    """A profile that measured the head (tools/profile_hardware.py: a head stage's FORWARD
    and BACKWARD beside a one-layer stage's) prices the last stage's head at exactly those
    passes at the measured shape; at other tokens and vocabularies the head keeps its rate
    relative to a layer's, so its time over a layer's goes with their flops. A profile file
    without the head's fields loads, and prices the head as before: its flops at a
    layer's rate, its backward at the layer's ratio."""
    preset = get_preset("tiny")  # 4 layers, one a stage: stage 1 a layer, stage 3 + the head
    layer, head = (0.010, 0.027), (0.060, 0.150)
    rate, head_backward = head_over_layer(preset, layer, head)
    measured = dataclasses.replace(
        with_pass_times(dataclasses.replace(get_hardware("paper-v100"), pass_overhead_s=0.0),
                        preset, 4, *layer),
        head_rate_over_layer=rate, head_backward_over_forward=head_backward)
    schedule = build_schedule("decoupled", 2, 4, 1, 2, [1, 1, 1, 1])
    last = BackwardStage(3, 0)

    def head_part(hardware, model, micro_batch):
        costs = derived_costs(schedule, model, hardware, micro_batch_size=micro_batch)
        return (costs.forward[3] - costs.forward[1],
                costs.backward[last] + costs.recompute[last]
                - costs.backward[BackwardStage(1, 0)] - costs.recompute[BackwardStage(1, 0)],
                costs.forward[1])
    forward, backward, _ = head_part(measured, preset, 4)
    assert (forward, backward) == pytest.approx(head)
    wide = dataclasses.replace(preset, vocab_size=4 * preset.planned_vocab_size)
    for model, micro_batch, vocab in ((preset, 8, 1), (wide, 4, 4), (wide, 1, 4)):
        forward, backward, layer_forward = head_part(measured, model, micro_batch)
        assert forward / layer_forward == pytest.approx(vocab * head[0] / layer[0])
        assert backward / forward == pytest.approx(head[1] / head[0])

    values = json.loads(measured.to_json())
    del values["head_rate_over_layer"], values["head_backward_over_forward"]
    old = profile_from_dict(values)
    assert (old.head_rate_over_layer, old.head_backward_over_forward) == (1.0, None)
    forward, backward, layer_forward = head_part(old, preset, 4)
    assert forward / layer_forward == pytest.approx(
        head_forward_flops_per_token(preset)
        / layer_forward_flops_per_token(preset, preset.seq_length))
    assert backward / forward == pytest.approx(layer[1] / layer[0])


def test_model_flops_are_megatron_0_19s_count():
    """megatron/training/training.py num_floating_point_operations (transformer_flops) of
    0.19 written out for a dense GPT with --swiglu and --group-query-attention, per global
    batch: query heads x --kv-channels (here twice hidden / heads) wide, the causal mask
    halving the attention core, the logits over the padded vocabulary."""
    model = ModelConfig("gqa", num_layers=3, hidden_size=64, ffn_hidden_size=176,
                        num_attention_heads=4, num_query_groups=2, seq_length=48,
                        vocab_size=1000, kv_channels=32)
    batch, s, h, layers = 5, 48, 64, 3
    query = 32 * 4
    key = value = 32 * 2
    self_attn_term = 3 * 2 * (h * (query + key + value) + query * h)
    self_attn_core_term = 3 * 2 * query / 2 * 2 * layers
    flops = (batch * s * (3 * 2 * h * (176 * 3) * layers + self_attn_term * layers
                          + 3 * 2 * h * 1024)  # 1000 padded to a multiple of 128
             + batch * s * s * self_attn_core_term)
    assert megatron_model_flops_per_token(model) * batch * s == pytest.approx(flops, rel=1e-15)


@pytest.mark.parametrize("out,expected", [
    ("a_dir", "--out {tmp}/a_dir: expected a file path, found a directory"),
    ("a_file/hw.json", "--out {tmp}/a_file/hw.json: its directory is not writable (expected a "
                       "writable directory ({tmp}/a_file is a file))"),
])
def test_a_profile_out_that_cannot_be_written_is_refused_before_measuring(out, expected,
                                                                          tmp_path, capsys):
    """Was an IsADirectoryError/NotADirectoryError traceback after a minute of measuring."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        profile_main(["--out", str(tmp_path / out), "--model-preset", "tiny"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()  # the program's name is argv[0]'s
    assert len(lines) == 1 and lines[0].endswith(": error: " + expected.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]


@pytest.mark.multiproc
def test_a_bad_input_of_the_profiler_is_its_only_line(tmp_path):
    """In a fresh interpreter, as a user runs it: megatron-core's import warnings (8 lines)
    came before the error line."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "profile_hardware.py"
    done = subprocess.run([sys.executable, str(tool), "--out", str(tmp_path),
                           "--model-preset", "tiny"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"profile_hardware.py: error: --out {tmp_path}: "
                                        "expected a file path, found a directory"]
