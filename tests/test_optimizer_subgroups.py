"""Optimizer subgroups: every k-th subgroup of a group updated through the device layer
(copies in, torch AdamW, flush out) while the C++ kernel updates the others; checked
against the same group stepped in one piece by the kernel."""

from dataclasses import replace

import pytest
import torch

from megatron.offload.device import DeviceLayer
from megatron.optimizer import AsyncGroupOptimizer, CPUAdamW, DynamicLossScaler
from megatron.optimizer.subgroups import plan_resident, plan_subgroups
from megatron.pipeline.subgroup_device import DeviceSubgroupUpdater, ResidentSubgroupUpdater
from megatron.schedules.subgroup_memory import SUBGROUP_SLOTS, subgroup_slots_bytes


def test_plan_marks_every_kth_subgroup_and_tiles_the_group():
    plan = plan_subgroups(10, 3, 2)
    assert [(s.lo, s.hi, s.on_device) for s in plan] == [
        (0, 3, False), (3, 6, True), (6, 9, False), (9, 10, True)]
    assert not any(s.on_device for s in plan_subgroups(10, 3, 0))
    # GPU-heavy (device:3): every 3rd on the CPU, the others on the device
    assert [s.on_device for s in plan_subgroups(10, 2, -3)] == [True, True, False, True, True]
    with pytest.raises(ValueError, match="N >= 2"):
        plan_subgroups(10, 2, -1)
    resident = plan_resident(10, 4, 0.5)
    assert [(s.lo, s.hi, s.on_device) for s in resident] == [
        (0, 4, True), (4, 5, True), (5, 9, False), (9, 10, False)]


def _pair(n, exact, wd=0.1, seed=0):
    init = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return [CPUAdamW([init], lr=1e-2, weight_decay=wd, threads=1, exact_rollback=exact)
            for _ in range(2)]


def _state(opt):
    return [t.clone() for t in (opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0))]


STREAMED = {"interleaved": 2, "gpu-heavy": -3}  # the split: stride 2, device:3


def _updater(kind, device, n, size):
    """Interleaved (every 2nd subgroup streamed through the device), GPU-heavy (all but
    every 3rd streamed) or Twin-Flow (the first 40% resident on the device)."""
    if kind in STREAMED:
        return DeviceSubgroupUpdater(device, size), plan_subgroups(n, size, STREAMED[kind])
    return ResidentSubgroupUpdater(device), plan_resident(n, size, 0.4)


@pytest.mark.parametrize("kind", ["interleaved", "gpu-heavy", "resident"])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_device_subgroups_match_the_kernel_step_rollback_and_correction(kind, exact, out_dtype):
    n, size = 5000, 700
    reference, split = _pair(n, exact)
    with DeviceLayer("cpu") as device:
        updater, plan = _updater(kind, device, n, size)
        split.set_subgroups(0, plan, updater)
        gen = torch.Generator().manual_seed(1)
        outs = [torch.empty(n, dtype=out_dtype) for _ in range(2)]
        for step in range(4):
            grad = torch.randn(n, generator=gen) * 4096.0  # unscaled by inv_scale below
            results = [opt.step_group(0, grad, inv_scale=1 / 4096.0, out=o, clip=0.5)
                       for opt, o in zip((reference, split), outs)]
            assert all(r.updated for r in results)
            assert results[1].grad_sq_sum == pytest.approx(results[0].grad_sq_sum, rel=1e-6)
            if step == 2:  # a clipping correction, then a rollback of another step
                for opt in (reference, split):
                    opt.correct_group(0, 0.125)
            if step == 3:
                for opt in (reference, split):
                    opt.rollback_group(0)
            for opt in (reference, split):
                if opt.has_update(0):
                    opt.commit_group(0)
            for got, want in zip(_state(split), _state(reference)):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-2 if out_dtype != torch.float32
                                       else 1e-6, atol=1e-7)
        on_device = sum(sub.on_device for sub in plan)  # 4 of 8 / 6 of 8 / 3 of 6
        assert on_device == {"interleaved": 4, "gpu-heavy": 6, "resident": 3}[kind]
        assert updater.launched == 4 * on_device
        split.step_group(0, torch.randn(n, generator=gen))  # after the rollback: state back in
        if kind in STREAMED:  # the two slots, as the memory model counts them
            assert updater.nbytes == subgroup_slots_bytes(size, out_dtype.itemsize)
        else:
            assert updater.nbytes >= 16 * 2000


def test_consecutive_device_subgroups_reuse_the_two_slots():
    """GPU-heavy (device:4: runs of 3 device subgroups), two groups stepping concurrently,
    under the sanitizer and chaos (copy streams delayed at random): the device buffers are
    the two slots, allocated once (the memory model's subgroup_slots_bytes), a slot is
    reloaded only after its flush (else the sanitizer fails the step or the numbers
    differ), and the results are the kernel's."""
    n, size = 4200, 300  # 14 subgroups per group, 11 on the device
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=gen) for _ in range(2)]
    grads = [[torch.randn(n, generator=gen) for _ in range(2)] for _ in range(3)]
    reference, split = (CPUAdamW([t.clone() for t in init], lr=1e-2, weight_decay=0.1, threads=1)
                        for _ in range(2))
    with DeviceLayer("cpu", sanitize=True, chaos_seed=7) as device:
        updater = DeviceSubgroupUpdater(device, size)
        for group in range(2):
            split.set_subgroups(group, plan_subgroups(n, size, -4), updater)
        outs = [[torch.empty(n, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
        for step_grads in grads:
            for opt, out in zip((reference, split), outs):
                with AsyncGroupOptimizer(opt, DynamicLossScaler(1.0), max_workers=2) as run:
                    for group, grad in enumerate(step_grads):
                        run.submit(group, grad, out=out[group])
                    run.wait_all()
                    run.synchronize()
                    run.end_iteration()
                    run.drain()
        assert updater.launched == 3 * 2 * 11
        assert len(updater._slots) == SUBGROUP_SLOTS
        # every device buffer the layer handed out, still held
        assert device.device_bytes == updater.nbytes == subgroup_slots_bytes(size, 2)
    for group in range(2):
        for got, want in zip(_state_of(split, group), _state_of(reference, group)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exact", [False, True])
def test_a_non_finite_gradient_in_any_subgroup_leaves_the_group_unchanged(exact):
    """As the kernel: bit-exact with the snapshot, else within the inverse's bound."""
    n, size = 3000, 500
    _, split = _pair(n, exact=exact)
    with DeviceLayer("cpu") as device:
        split.set_subgroups(0, plan_subgroups(n, size, 2), DeviceSubgroupUpdater(device, size))
        split.step_group(0, torch.randn(n))
        split.commit_group(0)
        before = _state(split)
        for bad in (600, 2600, 10):  # a device subgroup, another, a CPU subgroup
            grad = torch.randn(n)
            grad[bad] = float("inf")
            result = split.step_group(0, grad)
            assert not result.updated and not split.has_update(0)
            for got, want in zip(_state(split), before):
                if exact:
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["interleaved", "gpu-heavy", "resident"])
@pytest.mark.parametrize("clip_grad", [0.0, 1e-3])
def test_speculative_iterations_with_fp16_overflow_and_clipping_match_the_cpu_only_run(
        clip_grad, kind):
    """The decoupled optimizer's path (speculative steps, verdict, deferred corrections or
    rollback on an injected overflow) with device subgroups equals the CPU-only run."""
    n, size = 4000, 600
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=gen) for _ in range(2)]
    grads = [[(torch.randn(n, generator=gen) * 64).half() for _ in range(2)] for _ in range(4)]
    grads[2][1][1234] = float("inf")  # iteration 2 overflows in a device subgroup of group 1
    runs = []
    with DeviceLayer("cpu") as device:
        for subgroups in (False, True):
            adam = CPUAdamW([t.clone() for t in init], lr=1e-2, weight_decay=0.1, threads=1)
            if subgroups:
                updater, plan = _updater(kind, device, n, size)
                for group in range(2):
                    adam.set_subgroups(group, plan, updater)
            outs = [torch.empty(n, dtype=torch.float16) for _ in range(2)]
            results = []
            with AsyncGroupOptimizer(adam, DynamicLossScaler(64.0), clip_grad=clip_grad,
                                     max_workers=2) as opt:
                for step_grads in grads:
                    for group, grad in enumerate(step_grads):
                        opt.submit(group, grad, out=outs[group])
                    opt.wait_all()
                    opt.synchronize()
                    opt.correct_deferred([((0, 1), lambda: None)])
                    results.append(opt.end_iteration())
                opt.drain()
            runs.append((results, [_state_of(adam, g) for g in range(2)], outs))
    (ref_results, ref_state, ref_outs), (results, state, outs) = runs
    assert [r.skipped for r in results] == [r.skipped for r in ref_results] == [
        False, False, True, False]
    assert [r.clipped for r in results] == [r.clipped for r in ref_results]
    for group_got, group_want in zip(state, ref_state):
        for got, want in zip(group_got, group_want):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)


def _state_of(adam, group):
    return [t.clone() for t in (adam.master(group), adam.exp_avg(group), adam.exp_avg_sq(group))]


CLIP = ["--clip-grad", "1e-3", "--cpu-optimizer-threads", "1"]


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory, demo_cache):
    """One process with CLIP (torch's AdamW in memory, no pipeline): the reference of both
    multi-process tests below, started once (beside the first one's pipeline) and shared."""
    from tests.test_pipeline_executor import start

    run = start(tmp_path_factory.mktemp("clipped"), "single", 1, *CLIP)
    yield run
    run.wait()  # gone even when no test waited for it


@pytest.mark.multiproc
def test_schedules_with_device_subgroups_match_one_process(tmp_path, demo_cache,
                                                          clipped_reference):
    """2 processes, the decoupled and the interleaved schedule in one job, --optimizer-gpu-stride auto with the rates
    of the paper's worked example cached (Eq. 1: k = 2), clipping in every iteration (the
    corrections of device-updated subgroups and of the stages updated on the CPU alone
    included): training equals one process."""
    import json
    import os

    from megatron.data.demo_corpus import ensure_demo_corpus
    from megatron.data.tokenizer import load_tokenizer
    from megatron.pipeline.optimizer_calibration import CACHE_VERSION, machine_key
    from megatron.planning.shape import generate_schedule
    from megatron.schedules.memory_model import MemoryShape, plan_memory
    from megatron.training.arguments import parse_args
    from tests.test_pipeline_executor import (
        FEATURE_SCHEDULES,
        MODEL,
        ScheduleRun,
        assert_same_training,
        metrics,
        start,
    )

    cache_dir = demo_cache
    os.makedirs(cache_dir, exist_ok=True)
    with DeviceLayer("cpu") as device:
        key = machine_key(device, 1)
    rates = os.path.join(cache_dir, f"optimizer-rates-{key}.json")
    with open(rates, "w") as f:
        json.dump({"version": CACHE_VERSION, "rates": PAPER_RATES}, f)
    try:  # the paper's rates stand in for a calibration: never left for another run to use
        two = start(tmp_path, "subgroups", 2, *CLIP, "--optimizer-gpu-stride", "auto",
                    "--optimizer-subgroup-size", "2048", "--schedules",
                    ",".join(FEATURE_SCHEDULES), script="tests/run_schedules.py", timeout=600)
        reference, run = clipped_reference.wait(), two.wait()
    finally:
        os.remove(rates)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-4000:]
    assert "optimizer GPU stride k = 2" in run.stdout + run.stderr
    vocab = load_tokenizer(ensure_demo_corpus(cache_dir=cache_dir).tokenizer_path).vocab_size
    for name in FEATURE_SCHEDULES:
        one = ScheduleRun(run, name)
        assert_same_training(one, reference)
        rows = metrics(one)
        assert all(r["optimizer_gpu_stride"] == 2 for r in rows), name
        assert all(r["grad_norm"] > 1e-3 for r in rows)  # clipped in every iteration
        for r in rows:
            assert 0 <= r["exposed_optimizer_device_time_s"] <= r["exposed_optimizer_time_s"] + 1e-9
            assert 0 <= r["clip_corrections_exposed_s"] <= r["exposed_optimizer_time_s"]
            assert r["exposed_optimizer_cpu_time_s"] == pytest.approx(
                r["exposed_optimizer_time_s"] - r["exposed_optimizer_device_time_s"])
        peak = max(rank["device_memory_at_peak"]["optimizer_subgroups"]
                   for r in rows for rank in r["per_rank"])
        assert peak > 0, name  # device subgroups held their slots
        # the memory model (fit check, --plan) plans at least what the slots took
        config = parse_args([*MODEL, "--data-cache-dir", cache_dir, *CLIP,
                             "--pipeline-schedule", name, "--optimizer-gpu-stride", "auto",
                             "--optimizer-subgroup-size", "2048"])
        schedule = generate_schedule(config, 2, vocab)
        plan = plan_memory(schedule,
                           MemoryShape(replace(config.model, vocab_size=vocab), 2, 32, 4, 4),
                           config.cpu_optimizer.placement)
        for r in rows:
            for rank in r["per_rank"]:
                planned = plan.per_gpu[rank["rank"]]["optimizer_subgroups"]
                measured = rank["device_memory_at_peak"]["optimizer_subgroups"]
                assert measured <= planned <= 2 * max(measured, peak), (name, rank["rank"])


@pytest.mark.multiproc
def test_the_gpu_heavy_split_matches_one_process(tmp_path, demo_cache, clipped_reference):
    """2 processes, decoupled, --optimizer-gpu-stride device:3 (2 of every 3 subgroups of the
    exposed stages on the device), clipping in every iteration: training equals one
    process, and the device memory the subgroups held is what the memory model plans."""
    from megatron.data.demo_corpus import ensure_demo_corpus
    from megatron.data.tokenizer import load_tokenizer
    from megatron.planning.shape import generate_schedule
    from megatron.schedules.memory_model import MemoryShape, plan_memory
    from megatron.training.arguments import parse_args
    from tests.test_pipeline_executor import MODEL, assert_same_training, metrics, start

    clip = CLIP
    heavy = ["--optimizer-gpu-stride", "device:3", "--optimizer-subgroup-size", "2048"]
    two = start(tmp_path, "heavy", 2, *clip, "--pipeline-schedule", "decoupled", *heavy)
    reference, run = clipped_reference.wait(), two.wait()
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert_same_training(run, reference)
    rows = metrics(run)
    assert all(r["optimizer_gpu_stride"] == -3 for r in rows)
    assert all(r["grad_norm"] > 1e-3 for r in rows)  # clipped in every iteration
    config = parse_args([*MODEL, "--data-cache-dir", demo_cache, *clip,
                         "--pipeline-schedule", "decoupled", *heavy])
    vocab = load_tokenizer(ensure_demo_corpus(cache_dir=demo_cache).tokenizer_path).vocab_size
    schedule = generate_schedule(config, 2, vocab)
    plan = plan_memory(schedule, MemoryShape(replace(config.model, vocab_size=vocab), 2, 32, 4, 4),
                       config.cpu_optimizer.placement)
    measured = [max(rank["device_memory_at_peak"]["optimizer_subgroups"]
                    for r in rows for rank in r["per_rank"] if rank["rank"] == k)
                for k in range(2)]
    assert any(measured)
    assert measured == [plan.per_gpu[k]["optimizer_subgroups"] for k in range(2)]


# The paper's worked example (4 x V100, as in test_optimizer_stride.py): Eq. 1 gives k = 2.
PAPER_RATES = {"h2d_params_per_s": 3e9, "gpu_update_params_per_s": 35e9,
               "cpu_update_params_per_s": 2e9, "downscale_params_per_s": 8.7e9}


def test_placement_gives_device_subgroups_to_the_exposed_updates_and_the_simulator_prices_them():
    """Decoupled, 2 ranks: the stages whose backward ends the iteration are exposed; with
    their subgroups on the device the simulated exposed optimizer time drops, and the
    device part's copies occupy both copy streams."""
    from megatron.schedules.cost_model import DeviceUpdateCosts, uniform_costs
    from megatron.schedules.generators import build_schedule
    from megatron.schedules.instructions import BackwardStage, Op
    from megatron.schedules.optimizer_placement import (
        exposed_update_stages,
        startup_costs,
        with_device_subgroups,
    )
    from megatron.schedules.optimizer_stride import UpdateRates
    from megatron.schedules.simulator import simulate

    schedule = build_schedule("decoupled", 2, 4, 2, 4)
    exposed = exposed_update_stages(schedule, startup_costs(schedule))
    assert exposed == {BackwardStage(0, 0), BackwardStage(0, 1)}
    placed = with_device_subgroups(schedule, exposed)
    ops = [(ins.stage, ins.sub) for p in placed.programs for ins in p
           if ins.op == Op.OPTIMIZER_START_SUBGROUPS]
    assert sorted(ops) == [(0, 0), (0, 1)]
    # 1e6 parameters per stage, CPU update 1 s per stage; device: B = 1e7, Ug = 1e8 /s.
    params = {b: 1_000_000 for b in schedule.backward_stages()}
    costs = replace(uniform_costs(schedule, forward_time=0.5, backward_time=1.0,
                                  optimizer_time=2.0),
                    device_update=DeviceUpdateCosts(2, params,
                                                    UpdateRates(1e7, 1e8, 1e6, 1e9)))
    before, after = simulate(schedule, costs), simulate(placed, costs)
    assert after.exposed_optimizer_time < before.exposed_optimizer_time
    lanes = {(e.resource, e.kind) for e in after.events}
    assert {("h2d", "optimizer"), ("d2h", "optimizer"), ("device-optimizer", "optimizer")} <= lanes
    # these rates give k_real 0.33 (the CPU is the slow side): the GPU-heavy device:4 leaves
    # the CPU lane a quarter of each update (1 s), not half, and exposes less than the stride 2
    heavy = replace(costs, device_update=replace(costs.device_update, stride=-4))
    on_heavy = simulate(placed, heavy)
    assert on_heavy.exposed_optimizer_time < after.exposed_optimizer_time
    cpu_parts = [e.end - e.start for e in on_heavy.events
                 if e.resource == "cpu-optimizer" and (e.stage, e.sub) in ops]
    assert cpu_parts == pytest.approx([costs.optimizer[BackwardStage(0, 0)] / 4] * 2)
    no_device = replace(costs, device_update=None)  # the op then costs what OPTIMIZER_START does
    assert simulate(placed, no_device).exposed_optimizer_time == pytest.approx(
        simulate(schedule, no_device).exposed_optimizer_time)
