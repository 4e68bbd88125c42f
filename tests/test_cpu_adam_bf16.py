"""16-bit optimizer states: bf16 m and v (round to nearest) and a bf16 master (stochastic
rounding keyed by seed, parameter, index and step), against an independent numpy
reference that computes the random bits itself; layout independence; rollback and
clipping corrections; precision conversion on load."""

import zlib

import numpy as np
import pytest
import torch

from megatron.offload.device import DeviceLayer
from megatron.optimizer import CPUAdamW, available_isas
from megatron.optimizer.rounding import ElementRun
from megatron.optimizer.subgroups import plan_resident, plan_subgroups
from megatron.pipeline.subgroup_device import DeviceSubgroupUpdater, ResidentSubgroupUpdater

BF16 = torch.bfloat16
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


# --- the independent reference (numpy uint32 / float32, nothing from megatron) -------------

def np_fmix32(x):
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        return x ^ (x >> np.uint32(16))


def np_bits(seed, name, index, step):
    """The documented generator: h = fmix32((index >> 1) ^ key), its low half for an even
    index and its high half for an odd one; key from seed, name, step."""
    key = np_fmix32(np_fmix32(np_fmix32(seed) ^ np.uint32(zlib.crc32(name.encode())))
                    ^ np.uint32(step))
    index = index.astype(np.uint32)
    h = np_fmix32((index >> np.uint32(1)) ^ key)
    return np.where(index & np.uint32(1), h >> np.uint32(16), h & np.uint32(0xFFFF))


def np_to_bf16_nearest(x):
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = r.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def np_to_bf16_stochastic(x, bits):
    u = (x.view(np.uint32).astype(np.uint64) + bits) & 0xFFFF0000
    return np.where(np.isnan(x), x, u.astype(np.uint32).view(np.float32))


def np_adamw(p, m, v, grads, names_sizes, seed, stochastic, wd=WD, bf16_master=True):
    """AdamW in float32 (the kernel's order of operations), state rounded to bf16 after
    every step: m, v to nearest, p (bf16_master) stochastically with the documented bits
    or to nearest."""
    f = np.float32
    index = np.concatenate([np.arange(n) for _, n in names_sizes])
    for t, g in enumerate(grads, 1):
        bc1, bc2 = 1.0 - BETAS[0] ** t, 1.0 - BETAS[1] ** t
        p = p * f(1.0 - LR * wd)
        m = m + f(1.0 - BETAS[0]) * (g - m)
        v = v * f(BETAS[1]) + (f(1.0 - BETAS[1]) * g) * g
        denom = np.sqrt(v) * f(1.0 / np.sqrt(bc2)) + f(EPS)
        p = p + (f(-(LR / bc1)) * m) / denom
        m, v = np_to_bf16_nearest(m), np_to_bf16_nearest(v)
        if bf16_master and stochastic:
            bits = np.concatenate([np_bits(seed, name, np.arange(n), t) for name, n in names_sizes])
            p = np_to_bf16_stochastic(p, bits.astype(np.uint64))
        elif bf16_master:
            p = np_to_bf16_nearest(p)
        assert index.size == p.size
    return p, m, v


# --- helpers -------------------------------------------------------------------------------

NAMES = [("embedding.word_embeddings.weight", 3001), ("decoder.layers.0.mlp.weight", 5000),
         ("decoder.final_layernorm.weight", 77)]


def runs_for(layout):
    """Groups of (name, lo, hi) slices -> element runs (parameter = CRC-32 of the name)."""
    runs = []
    for group in layout:
        at, rows = 0, []
        for name, lo, hi in group:
            rows.append(ElementRun(at, at + hi - lo, zlib.crc32(name.encode()), lo))
            at += hi - lo
        runs.append(rows)
    return runs


def whole(gen):
    return {name: torch.randn(n, generator=gen) for name, n in NAMES}


def build(init, layout, **kw):
    groups = [torch.cat([init[name][lo:hi] for name, lo, hi in group]) for group in layout]
    return CPUAdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                    state_dtype=BF16, master_dtype=BF16, rounding_seed=1234,
                    element_runs=runs_for(layout), **kw)


def gathered(opt, layout, which):
    """{name: tensor} of the optimizer's master / exp_avg / exp_avg_sq."""
    pieces = {name: [] for name, _ in NAMES}
    for i, group in enumerate(layout):
        buf, at = getattr(opt, which)(i), 0
        for name, lo, hi in group:
            pieces[name].append((lo, buf[at:at + hi - lo]))
            at += hi - lo
    return {name: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for name, p in pieces.items()}


def step_all(opt, layout, grads):
    for i, group in enumerate(layout):
        g = torch.cat([grads[name][lo:hi] for name, lo, hi in group])
        assert opt.step_group(i, g).updated


ONE_GROUP = [[(name, 0, n) for name, n in NAMES]]
# The same parameters cut differently: a parameter split over two groups, other orders.
SPLIT = [[("decoder.layers.0.mlp.weight", 2500, 5000), ("embedding.word_embeddings.weight", 0, 1000)],
         [("decoder.final_layernorm.weight", 0, 77), ("embedding.word_embeddings.weight", 1000, 3001),
          ("decoder.layers.0.mlp.weight", 0, 2500)]]


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("stochastic", [True, False])
def test_bf16_states_and_master_equal_the_numpy_reference_bit_for_bit(isa, stochastic):
    gen = torch.Generator().manual_seed(0)
    init = whole(gen)
    grads = [whole(gen) for _ in range(4)]
    opt = build(init, ONE_GROUP, isa=isa, threads=2, stochastic_rounding=stochastic)
    out = torch.empty(opt.master(0).numel(), dtype=torch.float16)
    for g in grads:
        assert opt.step_group(0, torch.cat([g[name] for name, _ in NAMES]), out=out).updated
    p0 = np_to_bf16_nearest(torch.cat([init[name] for name, _ in NAMES]).numpy())
    zeros = np.zeros_like(p0)
    p, m, v = np_adamw(p0, zeros, zeros, [torch.cat([g[name] for name, _ in NAMES]).numpy()
                                          for g in grads], NAMES, 1234, stochastic)
    assert opt.master(0).dtype == BF16 and opt.exp_avg(0).dtype == BF16
    for got, want in ((opt.master(0), p), (opt.exp_avg(0), m), (opt.exp_avg_sq(0), v)):
        assert np.array_equal(got.float().numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(out, opt.master(0).to(torch.float16))  # the working copy is the master


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_states_beside_an_fp32_master_equal_the_numpy_reference_bit_for_bit(isa, threads):
    """--optimizer-state-dtype bf16: an fp32 master, bf16 m and v, a bf16 gradient and working
    copy; 8078 elements (a SIMD tail), gradient and copy at odd, unaligned addresses, and a
    nan and infinities in the master (the copy's nan rule)."""
    gen = torch.Generator().manual_seed(6)
    n = sum(size for _, size in NAMES)
    p0 = torch.randn(n, generator=gen) * torch.logspace(-3, 3, n)
    p0[[5, 100, 4001]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    grads = [torch.randn(n + 1, generator=gen).to(BF16)[1:] for _ in range(4)]
    opt = CPUAdamW([p0], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=BF16,
                   isa=isa, threads=threads)
    out = torch.empty(n + 1, dtype=BF16)[1:]
    for g in grads:
        assert opt.step_group(0, g, out=out).updated
    zeros = np.zeros(n, dtype=np.float32)
    p, m, v = np_adamw(p0.numpy(), zeros, zeros, [g.float().numpy() for g in grads], NAMES, 0,
                       False, bf16_master=False)
    assert opt.master(0).dtype == torch.float32 and opt.exp_avg(0).dtype == BF16
    for got, want in ((opt.master(0), p), (opt.exp_avg(0).float(), m),
                      (opt.exp_avg_sq(0).float(), v), (out.float(), np_to_bf16_nearest(p))):
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_the_result_does_not_depend_on_groups_subgroups_threads_or_device_updates():
    gen = torch.Generator().manual_seed(1)
    init = whole(gen)
    grads = [whole(gen) for _ in range(3)]
    results = []
    for layout, threads, subgroups in ((ONE_GROUP, 1, None), (SPLIT, 2, None),
                                       (SPLIT, 1, "interleaved"), (ONE_GROUP, 2, "resident")):
        opt = build(init, layout, threads=threads)
        with DeviceLayer("cpu") as device:
            if subgroups:  # subgroups of 700 through the device path (torch): every 2nd
                # one streamed, or the first 40% resident on the device
                updater = (DeviceSubgroupUpdater(device, 700) if subgroups == "interleaved"
                           else ResidentSubgroupUpdater(device))
                for i in range(len(layout)):
                    n = opt.master(i).numel()
                    plan = (plan_subgroups(n, 700, 2) if subgroups == "interleaved"
                            else plan_resident(n, 700, 0.4))
                    opt.set_subgroups(i, plan, updater)
            for g in grads:
                step_all(opt, layout, g)
                for i in range(len(layout)):
                    opt.commit_group(i)
            if subgroups:
                assert updater.launched > 0
            results.append({w: gathered(opt, layout, w) for w in ("master", "exp_avg", "exp_avg_sq")})
    for other in results[1:]:
        for which, tensors in results[0].items():
            for name, t in tensors.items():
                assert torch.equal(other[which][name], t), (which, name)


def test_stochastic_rounding_keeps_updates_smaller_than_half_a_bf16_step():
    """A constant gradient moves every weight by about lr per step (Adam normalizes): at
    1.0 that is 1/78 of a bf16 step, lost by rounding to nearest, kept on average by
    stochastic rounding; the fp32 master is the truth."""
    n, steps, lr = 20_000, 50, 1e-4
    finals = {}
    for name, master, stochastic in (("fp32", torch.float32, True), ("nearest", BF16, False),
                                     ("stochastic", BF16, True)):
        opt = CPUAdamW([torch.ones(n)], lr=lr, threads=1, master_dtype=master,
                       stochastic_rounding=stochastic)
        for _ in range(steps):
            opt.step_group(0, torch.full((n,), 0.5))
        finals[name] = opt.master(0).float().mean().item()
    assert finals["fp32"] == pytest.approx(1.0 - steps * lr, rel=1e-4)
    assert finals["nearest"] == 1.0  # every update rounded away
    assert finals["stochastic"] == pytest.approx(finals["fp32"], abs=2e-4)


@pytest.mark.parametrize("isa", available_isas())
def test_paired_elements_round_up_independently_with_the_right_probability(isa):
    """Elements 2j and 2j + 1 take the two halves of one hash: each must still round up
    with the probability of its dropped fraction, and independently of its partner. The
    first Adam step moves every weight by lr: 1 + 2^-9 is a quarter of the way from 1.0
    to the next bf16 value (1 + 2^-7)."""
    n = 1 << 18
    opt = CPUAdamW([torch.ones(n)], lr=2.0**-9, betas=BETAS, eps=EPS, weight_decay=0.0,
                   master_dtype=BF16, stochastic_rounding=True, rounding_seed=7, isa=isa,
                   threads=1)
    assert opt.step_group(0, -torch.ones(n)).updated
    p = opt.master(0).float()
    assert set(p.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    up = (p > 1.0).reshape(-1, 2).double()
    even, odd = up[:, 0], up[:, 1]
    assert even.mean().item() == pytest.approx(0.25, abs=0.01)
    assert odd.mean().item() == pytest.approx(0.25, abs=0.01)
    assert (even * odd).mean().item() == pytest.approx(0.0625, abs=0.005)  # independent


@pytest.mark.parametrize("isa", available_isas())
def test_exact_rollback_and_correction_in_bf16_are_bit_exact(isa):
    """Snapshot mode: a rollback gives back the pre-step bytes; a correction equals the
    step made with the right clip factor in the first place (same random bits)."""
    gen = torch.Generator().manual_seed(2)
    init, g1, g2 = whole(gen), whole(gen), whole(gen)
    flat = [torch.cat([g[name] for name, _ in NAMES]) for g in (g1, g2)]
    a = build(init, ONE_GROUP, isa=isa, exact_rollback=True, threads=2)
    b = build(init, ONE_GROUP, isa=isa, exact_rollback=True, threads=2)
    for opt in (a, b):
        opt.step_group(0, flat[0])
        opt.commit_group(0)
    before = [t.clone() for t in (a.master(0), a.exp_avg(0), a.exp_avg_sq(0))]
    a.step_group(0, flat[1], clip=1.0)
    a.rollback_group(0)
    for got, want in zip((a.master(0), a.exp_avg(0), a.exp_avg_sq(0)), before):
        assert torch.equal(got, want)
    assert a.step_count(0) == 1
    a.step_group(0, flat[1], clip=1.0)
    a.correct_group(0, 0.25)
    b.step_group(0, flat[1], clip=0.25)
    for got, want in zip((a.master(0), a.exp_avg(0), a.exp_avg_sq(0)),
                         (b.master(0), b.exp_avg(0), b.exp_avg_sq(0))):
        assert torch.equal(got, want)


def test_rollback_by_inverse_in_bf16_stays_within_the_stated_bound():
    """Without a snapshot the inverse starts from the rounded post-step values: each of p,
    m, v comes back within half a bf16 step of its own plus one bf16 step of its post-step
    value over beta (|back - old| <= 2^-8 |old| + 2^-7 |new| / beta + 2^-7 lr; see
    docs/cpu_optimizer.md)."""
    gen = torch.Generator().manual_seed(3)
    n, lr = 50_000, 1e-3
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=lr, weight_decay=0.1, threads=1,
                   state_dtype=BF16, master_dtype=BF16)
    for _ in range(3):
        opt.step_group(0, torch.randn(n, generator=gen))
        opt.commit_group(0)
    state = (opt.master, opt.exp_avg, opt.exp_avg_sq)
    before = [f(0).float().clone() for f in state]
    opt.step_group(0, torch.randn(n, generator=gen))
    after = [f(0).float().clone() for f in state]
    opt.rollback_group(0)
    for f, old, new, beta in zip(state, before, after, (1.0 - lr * 0.1, 0.9, 0.999)):
        error = (f(0).float() - old).abs()
        bound = 2.0 ** -8 * old.abs() + 2.0 ** -7 * new.abs() / beta + 2.0 ** -7 * lr
        assert bool((error <= bound).all()), float((error - bound).max())
        assert float(error.max()) > 0  # inexact indeed: the snapshot is what makes it exact


def test_loading_converts_precision_fp32_rounds_once_bf16_widens():
    gen = torch.Generator().manual_seed(4)
    n = 1000
    fp32 = CPUAdamW([torch.randn(n, generator=gen)], threads=1)
    fp32.step_group(0, torch.randn(n, generator=gen))
    half = CPUAdamW([torch.zeros(n)], threads=1, state_dtype=BF16, master_dtype=BF16)
    half.load_state_dict(fp32.state_dict())
    for key in ("master", "exp_avg", "exp_avg_sq"):
        got = getattr(half, key)(0)
        assert got.dtype == BF16
        assert torch.equal(got, getattr(fp32, key)(0).to(BF16))
    back = CPUAdamW([torch.zeros(n)], threads=1)
    back.load_state_dict(half.state_dict())
    assert back.master(0).dtype == torch.float32
    assert torch.equal(back.master(0), half.master(0).float())
    assert back.step_count(0) == 1


def test_bad_state_dtype_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="state_dtype=torch.float16"):
        CPUAdamW([torch.zeros(4)], state_dtype=torch.float16)


def test_a_checkpoint_loads_into_either_precision(tmp_path):
    """What a resume with a changed --master-dtype / --optimizer-state-dtype does: the
    saved fp32 tensor rounds once to bf16; a saved bf16 tensor widens exactly."""
    import torch.distributed.checkpoint as dcp

    from megatron.training.checkpointing import load_tensors

    gen = torch.Generator().manual_seed(5)
    saved = {"model.w": torch.randn(300, generator=gen),
             "optimizer.exp_avg.w": torch.randn(300, generator=gen).to(BF16)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    into = {"model.w": torch.empty(300, dtype=BF16),
            "optimizer.exp_avg.w": torch.empty(300, dtype=torch.float32)}
    load_tensors(str(tmp_path), into)
    assert torch.equal(into["model.w"], saved["model.w"].to(BF16))
    assert torch.equal(into["optimizer.exp_avg.w"], saved["optimizer.exp_avg.w"].float())


def test_the_planner_counts_host_bytes_per_parameter_of_the_chosen_precisions():
    """fp32: 12 bytes per owned parameter; bf16 m and v: 8; all bf16: 6 (what CPUAdamW
    allocates), and the paper's 110B on two nodes needs less host memory with them."""
    from megatron.config.presets import get_preset
    from megatron.schedules.cost_model import backward_stage_params, model_partition
    from megatron.schedules.generators import build_schedule
    from megatron.schedules.hardware import get_hardware
    from megatron.schedules.memory_model import MemoryShape, plan_memory

    preset, hardware = get_preset("110b"), get_hardware("paper-v100")
    partition = model_partition(preset, 16, min_layers=2)
    schedule = build_schedule("decoupled", 8, 16, 2, 16, partition)
    params = sum(backward_stage_params(preset, partition, 2).values())
    node_states = []
    for master, states, expected in ((torch.float32, torch.float32, 12),
                                     (torch.float32, BF16, 8), (BF16, BF16, 6)):
        opt = CPUAdamW([torch.zeros(10)], threads=1, master_dtype=master, state_dtype=states)
        assert opt.bytes_per_param == expected
        plan = plan_memory(schedule, MemoryShape(preset, 2, 1024, 2, 4, opt.bytes_per_param,
                                                 procs_per_node=4), hardware=hardware)
        total = sum(node["optimizer_states"] for node in plan.per_node)
        assert total == expected * params
        node_states.append(max(node["optimizer_states"] for node in plan.per_node))
    assert node_states[0] > hardware.host_memory_bytes > node_states[2]


@pytest.mark.parametrize("flag", ["--master-dtype", "--optimizer-state-dtype"])
def test_bf16_flags_with_the_one_process_reference_exit_2_naming_the_flag(flag, capsys):
    """The one-process reference keeps torch's fp32 AdamW: a bf16 flag with it is refused
    (one line, exit 2); without a schedule one process runs the one-rank pipeline."""
    from megatron.pipeline.config import pipeline_config
    from megatron.planning.run_plan import plan_on_profile
    from megatron.schedules.hardware import get_hardware
    from megatron.training.arguments import parse_args
    from megatron.training.training import runs_pipeline

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-preset", "tiny", "--pipeline-schedule", "single", flag, "bf16"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in line and "bf16" in line
    run = parse_args(["--model-preset", "tiny", flag, "bf16"])
    assert runs_pipeline(run, world_size=1)
    plan = plan_on_profile(run.evolve(planning={"gpus_per_node": 1}, model={"vocab_size": 4096}),
                           get_hardware("paper-v100"))
    config = pipeline_config(run, plan)
    dtypes = (config.optimizer.master_dtype, config.optimizer.state_dtype)
    assert dtypes == ((BF16, torch.float32) if flag == "--master-dtype" else (torch.float32, BF16))
