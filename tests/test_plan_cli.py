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
    assert {"paper-v100", "h100-sxm", "dgx-h100"} <= set(HARDWARE_PROFILES)
    v100 = HARDWARE_PROFILES["paper-v100"]
    # 32 GB of HBM2, as much as CUDA reports of it (PyTorch: "31.74 GiB total capacity")
    assert v100.gpus_per_node == 4 and v100.gpu_memory_bytes == 34089730048
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
              "--num-attention-heads", "64", "--group-query-attention",
              "--num-query-groups", "8", "--seq-length", "32",
              "--train-iters", "1", "--data-cache-dir", demo_cache])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_llama.py: error: /dev/shm: the parameters (fp32) of "
                             "this node's stages would need"), err[0]
    assert "GiB free (" in err[0] and "GiB short)" in err[0]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


# --- the optimizer state's precision before more nodes ---------------------------------------

SMALL_RUN = ("--model-preset", "10b", "--num-layers", "8", "--bf16", "--gpus-per-node", "2",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "256")
STATE_FLAGS = {8: ["--optimizer-state-dtype", "bf16"],
               6: ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"]}


def _profile(tmp_path, host_bytes: int) -> str:
    """paper-v100 with `host_bytes` of host memory, as a profile file."""
    values = dict(vars(get_hardware("paper-v100")), name="host-sized", host_memory_bytes=host_bytes)
    path = tmp_path / "host-sized.json"
    path.write_text(json.dumps(values))
    return str(path)


def _host_with_state_bytes(capsys, state_bytes: float) -> int:
    """The host memory SMALL_RUN's node needs with `state_bytes` of optimizer state per
    parameter, from its plan at 12 bytes (the state scales with its bytes, nothing else)."""
    _, out = plan(capsys, *SMALL_RUN)
    node = out["per_node"][0]
    return int(sum(v for k, v in node.items() if k not in ("node", "optimizer_states"))
               + node["optimizer_states"] * state_bytes / 12)


@pytest.mark.parametrize("state_bytes", [8, 6])
def test_a_node_short_of_host_memory_is_offered_a_cheaper_optimizer_state_first(
        capsys, tmp_path, state_bytes):
    """Host memory between what `state_bytes` and the next richer state need: the nearest
    fit keeps the one node and names the precision; planned with those flags, it fits."""
    richer = {8: 12, 6: 8}[state_bytes]
    host = (_host_with_state_bytes(capsys, state_bytes)
            + _host_with_state_bytes(capsys, richer)) // 2
    profile = _profile(tmp_path, host)
    code, out = plan(capsys, *SMALL_RUN, "--hardware", profile)
    assert code == 3 and out["resource"] == "host memory"
    nearest = out["nearest_fit"]
    assert nearest["fits"] and nearest["nodes"] == 1
    assert nearest["optimizer_bytes_per_param"] == state_bytes
    assert nearest["flags"].endswith(" ".join(STATE_FLAGS[state_bytes]))
    assert nearest["predicted_iteration_s"] > 0
    # what a user does next: plan again with the suggested flags
    again, fitted = plan(capsys, *SMALL_RUN, "--hardware", profile, *STATE_FLAGS[state_bytes])
    assert again == 0 and fitted["per_node"][0]["optimizer_states"] == pytest.approx(
        out["per_node"][0]["optimizer_states"] * state_bytes / 12, rel=1e-9)
    # and the text says why
    assert main(["--plan", *SMALL_RUN, "--hardware", profile]) == 3
    suggestion = capsys.readouterr().out.strip().splitlines()[-1]
    assert suggestion.startswith("nearest configuration that fits: ")
    assert f"{state_bytes} bytes per parameter instead of 12" in suggestion
    assert "MFU" in suggestion


def test_more_nodes_only_when_no_precision_saves_one(capsys, tmp_path):
    """Too little host memory for one node at any precision: the suggestion is the fewest
    nodes at which some precision fits, and the richest precision that fits there."""
    profile = _profile(tmp_path, _host_with_state_bytes(capsys, 6) * 2 // 3)
    code, out = plan(capsys, *SMALL_RUN, "--hardware", profile)
    nearest = out["nearest_fit"]
    assert code == 3 and nearest["fits"] and nearest["nodes"] > 1
    nodes = nearest["nodes"]
    fewer = ["--nodes", str(nodes - 1)]
    assert plan(capsys, *SMALL_RUN, "--hardware", profile, *fewer, *STATE_FLAGS[6])[0] == 3
    richer = {12: None, 8: [], 6: STATE_FLAGS[8]}[nearest["optimizer_bytes_per_param"]]
    if richer is not None:  # the precision one step richer does not fit those nodes
        assert plan(capsys, *SMALL_RUN, "--hardware", profile, "--nodes", str(nodes),
                    *richer)[0] == 3


def test_auto_config_searches_a_cheaper_optimizer_state_when_nothing_fits(capsys, tmp_path):
    """One node whose host memory holds 8 bytes of state per parameter, not 12: the
    candidates are searched with bf16 m and v, and the plan says nothing fitted at 12."""
    host = (_host_with_state_bytes(capsys, 8) + _host_with_state_bytes(capsys, 12)) // 2
    profile = _profile(tmp_path, host)
    code, out = plan(capsys, "--auto-config", *SMALL_RUN, "--hardware", profile)
    assert code == 0 and out["fits"]
    assert out["search"]["nothing_fits_at"] == [12]
    assert out["candidates"] and all(
        c["fits"] and c["optimizer_bytes_per_param"] == 8
        and "--optimizer-state-dtype bf16" in c["flags"] for c in out["candidates"])
    assert out["configuration"]["optimizer_bytes_per_param"] == 8
    assert main(["--plan", "--auto-config", *SMALL_RUN, "--hardware", profile]) == 0
    text = capsys.readouterr().out
    assert "nothing fits with 12 bytes of optimizer state per parameter" in text
    assert "searched with --optimizer-state-dtype bf16 (8 bytes per parameter)" in text


def test_the_predicted_mfu_is_the_model_flops_over_the_gpus_peak(capsys):
    """MFU against 6 flops per parameter and token (attention and the embedding's lookup
    differ by a few per cent at this shape)."""
    _, out = plan(capsys, "--model-preset", "10b", "--bf16", "--nodes", "1",
                  "--micro-batch-size", "2", "--global-batch-size", "16")
    c, v100 = out["configuration"], get_hardware("paper-v100")
    params = out["per_node"][0]["optimizer_states"] / 12  # one node owns every stage
    tokens = c["micro_batches"] * c["micro_batch_size"] * 1024
    reference = 6 * params * tokens / (c["predicted_iteration_s"] * 4 * v100.gpu_peak_flops)
    assert 0 < c["mfu"] < 1
    assert c["mfu"] == pytest.approx(reference, rel=0.05)


def test_110b_on_one_dgx_h100_node(capsys):
    """The nodes users rent: 8 x H100, 2 TiB. 110B's fp32 optimizer state (12 bytes per
    parameter) fits one node's host memory, so no cheaper precision is needed."""
    dgx = HARDWARE_PROFILES["dgx-h100"]
    assert (dgx.gpus_per_node, dgx.host_memory_bytes, dgx.cpu_cores) == (8, 2 * 2**40, 112)
    code, out = plan(capsys, "--model-preset", "110b", "--bf16", "--hardware", "dgx-h100",
                     "--nodes", "1")
    assert code == 0 and out["fits"] and len(out["per_gpu"]) == 8
    node = out["per_node"][0]
    assert node["optimizer_states"] == pytest.approx(12 * 98.29e9, rel=0.001)
    assert sum(v for k, v in node.items() if k != "node") <= dgx.host_memory_bytes
    assert out["configuration"]["optimizer_bytes_per_param"] == 12
    assert 0 < out["configuration"]["mfu"] < 1


def test_nodes_for_gpu_memory_are_found_beyond_what_host_memory_implies(capsys):
    """110B at 2048 tokens on 2 paper nodes: short of host memory (fewer nodes would do with
    a bf16 state) and of GPU memory (which needs more): the nearest fit is still found, and
    one node fewer does not fit even with the cheapest state."""
    run = ("--model-preset", "110b", "--bf16", "--micro-batch-size", "2",
           "--global-batch-size", "32", "--seq-length", "2048")
    code, out = plan(capsys, *run, "--nodes", "2")
    assert code == 3 and {s["resource"] for s in out["shortfalls"]} == {"host memory",
                                                                         "gpu memory"}
    nearest = out["nearest_fit"]
    assert nearest is not None and nearest["fits"]
    fewer = str(nearest["nodes"] - 1)
    assert plan(capsys, *run, "--nodes", fewer, *STATE_FLAGS[6])[0] == 3


def test_a_bf16_run_short_of_gpu_memory_is_offered_its_main_gradients_in_bf16(capsys,
                                                                              tmp_path):
    """One layer per stage and micro-batches of 1 (no stage or micro-batch knob left), on a
    GPU that holds the run's gradient buffers in bf16 but not in fp32: the nearest fit is
    --grad-reduce-in-bf16 on the same node, before a second node, and says what it
    changes; the run with that flag does fit."""
    v100 = get_hardware("paper-v100")
    path = tmp_path / "small-gpu.json"
    path.write_text(json.dumps(dict(vars(v100), name="small-gpu",
                                    gpu_memory_bytes=v100.gpu_reserved_bytes + 7 * 2**29)))
    run = ("--model-preset", "10b", "--bf16", "--hardware", str(path), "--nodes", "1",
           "--gpus-per-node", "2", "--num-layers", "8", "--forward-stages", "8",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "1024")
    code, out = plan(capsys, *run)
    assert code == 3 and {s["resource"] for s in out["shortfalls"]} == {"gpu memory"}
    nearest = out["nearest_fit"]
    assert nearest["fits"] and nearest["nodes"] == 1
    assert nearest["flags"].endswith("--grad-reduce-in-bf16")
    code, fitted = plan(capsys, *run, "--grad-reduce-in-bf16")
    assert code == 0 and fitted["fits"]
    assert fitted["configuration"]["predicted_iteration_s"] == pytest.approx(
        nearest["predicted_iteration_s"])
    assert main(["--plan", *run]) == 3
    text = capsys.readouterr().out.splitlines()[-1]
    assert "--grad-reduce-in-bf16 (the main gradients in bf16 instead of fp32" in text


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
    from megatron.planning.fit import FreeMemory, first_shortfall
    from megatron.planning.run_plan import run_start
    from megatron.training.arguments import parse_args

    run = parse_args(["--model-preset", "tiny", "--pipeline-schedule", "decoupled",
                      "--vocab-size", "1000"])
    plan = run_start(run, 1, procs_per_node=1, on_cuda=False).memory
    need = plan.per_node[0]["shm_parameters"]
    assert 2**20 < need < 2**30  # the case: MiB, not GiB
    error = first_shortfall(plan, 0, FreeMemory(shm=2**20, host=2**40, device=None), 4)
    text = str(error)
    assert f"would need {need / 2**20:.2f} MiB, 1.00 MiB free" in text, text
    assert f"({(need - 2**20) / 2**20:.2f} MiB short)" in text



def test_auto_starts_where_stride_0_fits_and_its_subgroups_get_only_what_is_left():
    """A GPU that holds stride 0's plan but not the subgroups besides (the case that made
    auto lose on an H100): the start does not refuse auto, whose subgroups get the bytes
    left beyond the plan (the plan caps them there, or resolves to stride 0)."""
    from megatron.planning.fit import FreeMemory, device_headroom, first_shortfall
    from megatron.planning.run_plan import run_start
    from megatron.training.arguments import parse_args

    base = ["--model-preset", "tiny", "--pipeline-schedule", "decoupled", "--vocab-size", "1000"]
    auto = parse_args([*base, "--optimizer-gpu-stride", "auto"])
    split = parse_args([*base, "--optimizer-gpu-stride", "2"])
    start = run_start(auto, 2, procs_per_node=2, on_cuda=True).memory
    with_subgroups = run_start(split, 2, procs_per_node=2, on_cuda=True).memory
    rank = next(r for r in range(2) if with_subgroups.gpu_total(r) > start.gpu_total(r))
    tight = FreeMemory(shm=2**40, host=2**40, device=start.gpu_total(rank) + 1000)
    assert first_shortfall(with_subgroups, rank, tight, 4) is not None
    assert first_shortfall(start, rank, tight, 4) is None
    assert device_headroom(start, rank, tight) == 1000
    # the CPU device layer: the rank's share of the node's host memory beyond the plan
    cpu = run_start(auto, 2, procs_per_node=2, on_cuda=False).memory
    host_need = (sum(cpu.per_node[0][k] for k in ("shm_parameters", "optimizer_states",
                                                  "host_gradients"))
                 + cpu.gpu_total(0) + cpu.gpu_total(1))
    on_cpu = FreeMemory(shm=2**40, host=host_need + 2000, device=None)
    assert device_headroom(cpu, rank, on_cpu) == 1000


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


def test_the_nvme_tier_is_suggested_before_more_nodes_when_the_node_has_drives(capsys,
                                                                               tmp_path):
    """110B on 2 paper nodes (1 layer per stage): no precision fits host memory, the states
    on the drives with bf16 m and v do, at the same 2 nodes; the same node without drives
    needs more nodes. The plan with the tier says how busy the drive is."""
    run = ("--model-preset", "110b", "--bf16", "--hardware", "paper-v100", "--nodes", "2",
           "--forward-stages", "80", "--backward-split", "1")
    code, out = plan(capsys, *run)
    assert code == 3
    nearest = out["nearest_fit"]
    assert nearest["fits"] and nearest["nodes"] == 2
    assert "--optimizer-state-location nvme" in nearest["flags"]
    assert nearest["nvme_busy_s"] <= nearest["predicted_iteration_s"]
    assert 0 < nearest["nvme_bytes_per_node"] <= 7.68e12
    values = dict(vars(get_hardware("paper-v100")), name="no-drives", nvme_read_bytes_per_s=0,
                  nvme_write_bytes_per_s=0, nvme_capacity_bytes=0)
    (tmp_path / "no-drives.json").write_text(json.dumps(values))
    code, out = plan(capsys, *run[:4], str(tmp_path / "no-drives.json"), *run[5:])
    assert code == 3 and "nvme" not in out["nearest_fit"]["flags"]
    assert out["nearest_fit"]["nodes"] > 2


def test_the_text_plan_prints_every_column_header_whole(capsys):
    from megatron.schedules.memory_model import GPU_TERMS, NODE_TERMS

    code = main(["--plan", "--model-preset", "10b", "--bf16", "--nodes", "1",
                 "--micro-batch-size", "2", "--global-batch-size", "16"])
    out = capsys.readouterr().out.splitlines()
    gpu_head = next(line for line in out if line.startswith("per GPU"))
    node_head = next(line for line in out if line.startswith("per node"))
    assert code == 0
    for term in GPU_TERMS:
        assert term.replace("_", " ") in gpu_head, gpu_head
    for term in NODE_TERMS:
        assert term.replace("_", " ") in node_head, node_head
    rank0 = next(line for line in out if line.startswith("rank 0"))
    assert len(rank0.split()) == 2 + len(GPU_TERMS) + 2  # label, terms, total, free


LLAMA2_7B = ("--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
             "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "32000",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16")


def test_a_one_gpu_plan_names_the_largest_llama2_shape_it_trains(capsys, tmp_path):
    """One H100 with 128 GiB of host memory: LLaMA-2 7B fits with its states in host
    memory, and the plan names the largest shape that does and why the next does not. A
    user planning that answer with the flags it gives sees it fit, and the next one not
    even with the cheapest optimizer state."""
    code, out = plan(capsys, *LLAMA2_7B, "--hardware", "h100-host128")
    assert code == 0 and out["fits"]
    largest, following = out["largest_model"], out["largest_model"]["next"]
    # at least the 7B just planned (its 16-bit parameters are what /dev/shm holds)
    assert largest["parameters"] >= out["per_node"][0]["shm_parameters"] / 2 >= 6.7e9
    assert largest["predicted_iteration_s"] > 0 and 0 < largest["mfu"] < 1
    assert following["parameters"] > largest["parameters"]
    assert following["does_not_fit"].startswith("host memory")
    sequence = ("--seq-length", "4096", "--vocab-size", "32000", "--global-batch-size", "4",
                "--bf16", "--hardware", "h100-host128")
    assert main(["--plan", *largest["shape"].split(), *largest["flags"].split(),
                 *sequence]) == 0
    assert "fits: yes" in capsys.readouterr().out
    code, out = plan(capsys, *following["shape"].split(), *sequence,
                     "--optimizer-state-dtype", "bf16", "--master-dtype", "bf16")
    assert code == 3 and out["resource"] == "host memory"
    # with a drive, the optimizer states on NVMe take it further
    drive = dict(vars(get_hardware("h100-host128")), name="with-drive",
                 nvme_read_bytes_per_s=6.4e9, nvme_write_bytes_per_s=4e9,
                 nvme_capacity_bytes=3_840_000_000_000)
    (tmp_path / "drive.json").write_text(json.dumps(drive))
    code, out = plan(capsys, *LLAMA2_7B, "--hardware", str(tmp_path / "drive.json"))
    assert out["largest_model"]["parameters"] > largest["parameters"]
    assert "--optimizer-state-location nvme" in out["largest_model"]["flags"]
    # the question is one GPU's: a plan for two does not ask it
    code, out = plan(capsys, *LLAMA2_7B, "--hardware", "h100-sxm", "--gpus-per-node", "2")
    assert "largest_model" not in out
