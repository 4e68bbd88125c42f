"""`pretrain_llama.py --plan` and `--auto-config`, and the trainer refusing what cannot fit."""

import json
import os

import pytest

from megatron.offload.naming import namespace
from megatron.schedules.hardware import HARDWARE_PROFILES, get_hardware
from megatron.training.training import main


def plan(capsys, *argv):
    code = main(["--plan", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_10b_fits_one_paper_node(capsys):
    code, out = plan(capsys, "--model-preset", "10b", "--bf16", "--nodes", "1",
                     "--micro-batch-size", "2", "--global-batch-size", "16")
    assert code == 0 and out["fits"] is True
    assert len(out["per_gpu"]) == 4 and len(out["per_node"]) == 1
    assert out["configuration"]["predicted_iteration_s"] > 0
    for row in out["per_gpu"]:
        assert sum(v for k, v in row.items() if k != "rank") <= out["capacity"]["gpu_free"]
    # 8.39 B parameters: 12 bytes of optimizer state each on the one node
    assert out["per_node"][0]["optimizer_states"] == pytest.approx(12 * 8.39e9, rel=0.01)


def test_too_little_host_memory_exits_3_naming_it_and_the_nodes_that_fit(capsys, tmp_path):
    small_host = dict(vars(get_hardware("paper-v100")), name="small-host",
                      host_memory_bytes=16 * 2**30)
    path = tmp_path / "small-host.json"
    path.write_text(json.dumps(small_host))
    code, out = plan(capsys, "--model-preset", "10b", "--num-layers", "8", "--bf16",
                     "--hardware", str(path), "--gpus-per-node", "2",
                     "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "256")
    assert code == 3 and out["fits"] is False
    assert out["resource"] == "host memory"
    assert out["short_by"] == out["needed"] - out["available"] > 0
    nearest = out["nearest_fit"]
    assert nearest["fits"] and nearest["nodes"] > 1


def test_bad_hardware_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--plan", "--model-preset", "tiny", "--hardware", "a100-nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hardware a100-nope" in err[0] and "paper-v100" in err[0]


def test_builtin_profiles_name_their_sources():
    assert {"paper-v100", "h100-sxm"} <= set(HARDWARE_PROFILES)
    v100 = HARDWARE_PROFILES["paper-v100"]
    assert v100.gpus_per_node == 4 and v100.gpu_memory_bytes == 32 * 2**30
    assert v100.host_memory_bytes == 512 * 2**30 and v100.cpu_cores == 32
    assert all(p.source for p in HARDWARE_PROFILES.values())


def test_plan_auto_config_prints_the_fastest_fitting_candidates(capsys):
    code, out = plan(capsys, "--auto-config", "--model-preset", "tiny", "--gpus-per-node", "2")
    assert code == 0 and out["fits"]
    found = out["candidates"]
    times = [c["predicted_iteration_s"] for c in found]
    assert len(found) == 5 and times == sorted(times) and all(c["fits"] for c in found)
    assert out["configuration"]["flags"] == found[0]["flags"]
    _, default = plan(capsys, "--model-preset", "tiny", "--gpus-per-node", "2")
    assert times[0] <= default["configuration"]["predicted_iteration_s"]


@pytest.mark.multiproc  # reads the demo corpus
def test_a_run_that_cannot_fit_shared_memory_exits_2_before_any_segment(demo_cache, capsys):
    """A one-process pipeline whose fp32 parameters (~225 GB) exceed /dev/shm: refused in one
    line before a segment of this process (named after its pid) exists."""
    prefix = namespace(f"process:{os.getpid()}", 0)
    with pytest.raises(SystemExit) as stop:
        main(["--pipeline-schedule", "decoupled", "--forward-stages", "2", "--num-layers", "64",
              "--hidden-size", "8192", "--ffn-hidden-size", "22016",
              "--num-attention-heads", "64", "--num-query-groups", "8", "--seq-length", "32",
              "--train-iters", "1", "--data-cache-dir", demo_cache])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_llama.py: error: /dev/shm: the parameters (fp32) of "
                             "this node's stages would need"), err[0]
    assert "GiB free (" in err[0] and "GiB short)" in err[0]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_an_absurd_global_batch_is_refused_naming_the_flag_and_the_limit(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--plan", "--model-preset", "tiny", "--global-batch-size", "40000000"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--global-batch-size 40000000" in err[0]
    assert "expected at most 100000" in err[0]


def test_a_small_dev_shm_is_reported_in_units_that_show_the_shortfall():
    """A 1 MiB /dev/shm against a few MiB of parameters used to read 'need 0.0 GiB, 0.0 GiB
    free'."""
    from megatron.planning.fit import FreeMemory, first_shortfall, run_memory_plan
    from megatron.planning.shape import generate_schedule
    from megatron.training.arguments import parse_args

    run = parse_args(["--model-preset", "tiny", "--pipeline-schedule", "decoupled"])
    schedule = generate_schedule(run, 1, 1000)
    plan = run_memory_plan(run, schedule, 1000, procs_per_node=1, on_cuda=False)
    need = plan.per_node[0]["shm_parameters"]
    assert 2**20 < need < 2**30  # the case: MiB, not GiB
    error = first_shortfall(plan, 0, FreeMemory(shm=2**20, host=2**40, device=None), 4)
    text = str(error)
    assert f"would need {need / 2**20:.2f} MiB, 1.00 MiB free" in text, text
    assert f"({(need - 2**20) / 2**20:.2f} MiB short)" in text



@pytest.mark.parametrize("content,fragment", [
    (bytes(range(128, 256)), "byte 0 is not UTF-8"),
    (b'{"name": "x",', "line 1 column"),
])
def test_a_hardware_file_that_is_not_json_is_one_line(content, fragment, tmp_path, capsys):
    path = tmp_path / "hw.json"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as stop:
        main(["--plan", "--model-preset", "tiny", "--hardware", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"--hardware {path}" in err[0] and "is not a JSON profile" in err[0]
    assert fragment in err[0]
