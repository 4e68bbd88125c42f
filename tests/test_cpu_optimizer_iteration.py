"""One optimizer step per iteration over several groups: post-step validation, rollback,
loss-scale backoff, the synchronous baseline, clipping, failures, several ranks."""

import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.common.ports import reserved_port
from megatron.optimizer import (
    AsyncGroupOptimizer,
    ConstantLossScaler,
    CPUAdamW,
    DynamicLossScaler,
    GroupTaskError,
)
from megatron.optimizer.iteration_verdict import clip_factor

SIZES = (5000, 7001, 3000)


def make(exact=True, mode="async", scale=2.0**10, **kwargs):
    gen = torch.Generator().manual_seed(0)
    adam = CPUAdamW([torch.randn(n, generator=gen) for n in SIZES], lr=1e-2, weight_decay=0.1,
                    threads=2, exact_rollback=exact)
    scaler = DynamicLossScaler(scale, growth_interval=1000)
    return AsyncGroupOptimizer(adam, scaler, mode=mode, **kwargs)


def grads_for(iteration, scale, bad_group=None):
    gen = torch.Generator().manual_seed(100 + iteration)
    grads = [(torch.randn(n, generator=gen) * scale).half() for n in SIZES]
    if bad_group is not None:
        grads[bad_group][17] = float("inf")
    return grads


def run_iteration(opt, grads, outs):
    """Submit groups in backward order; each gradient 'lands' from another thread."""
    landed = [threading.Event() for _ in grads]
    for group in reversed(range(len(grads))):
        opt.submit(group, grads[group], ready=landed[group], out=outs[group])
    lander = threading.Thread(target=lambda: [e.set() for e in reversed(landed)])
    lander.start()
    lander.join()
    return opt.finish_iteration()


def snapshot(opt, outs):
    a = opt.optimizer
    return [t.clone() for s in range(a.num_groups)
            for t in (a.master(s), a.exp_avg(s), a.exp_avg_sq(s))] + [o.clone() for o in outs]


def same(xs, ys, exact):
    if exact:
        return all(torch.equal(x, y) for x, y in zip(xs, ys))
    return all(torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-7) for x, y in zip(xs, ys))


@pytest.mark.parametrize("exact", [True, False])
def test_injected_overflow_rolls_back_every_group_and_backs_off(exact):
    opt = make(exact)
    outs = [torch.empty(n, dtype=torch.float16) for n in SIZES]
    with opt:
        assert not run_iteration(opt, grads_for(1, 2.0**10), outs).skipped
        before = snapshot(opt, outs)
        result = run_iteration(opt, grads_for(2, 2.0**10, bad_group=1), outs)
        assert result.skipped and result.mode == "async"
        assert result.overflow_groups == (1,)
        assert result.rolled_back_groups == (0, 2)
        assert opt.scaler.scale == 2.0**9
        assert result.loss_scale == 2.0**9  # the backed-off scale, as Megatron logs it
        assert same(snapshot(opt, outs), before, exact)
        assert [opt.optimizer.step_count(s) for s in range(3)] == [1, 1, 1]
        # the next iteration proceeds as if the skipped one never happened
        third = grads_for(3, 2.0**9)
        assert not run_iteration(opt, third, outs).skipped
        after = snapshot(opt, outs)

    reference = make(exact)
    ref_outs = [torch.empty(n, dtype=torch.float16) for n in SIZES]
    with reference:
        run_iteration(reference, grads_for(1, 2.0**10), ref_outs)
        reference.scaler.update(found_overflow=True)
        run_iteration(reference, third, ref_outs)
        assert same(after, snapshot(reference, ref_outs), exact)


def test_sync_schedule_gives_the_same_training_as_async():
    histories = {}
    for mode in ("async", "sync"):
        opt = make(mode=mode)
        outs = [torch.empty(n, dtype=torch.float16) for n in SIZES]
        with opt:
            results = [run_iteration(opt, grads_for(i, opt.scaler.scale, bad), outs)
                       for i, bad in enumerate((None, 2, None, 0, None))]
        assert all(r.mode == mode for r in results)
        histories[mode] = ([r.skipped for r in results], snapshot(opt, outs))
    assert histories["async"][0] == histories["sync"][0] == [False, True, False, True, False]
    assert same(histories["async"][1], histories["sync"][1], exact=True)


def test_post_validation_starts_after_n_clean_iterations():
    opt = make(post_validation_after=2)
    outs = [None] * 3
    with opt:
        modes = [run_iteration(opt, grads_for(i, 1.0, bad), outs).mode
                 for i, bad in enumerate((None, 1, None, None, None, 0))]
    # the overflow in iteration 1 restarts the count of clean iterations
    assert modes == ["sync", "sync", "sync", "sync", "async", "async"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_clipping_by_global_norm_matches_torch(mode):
    max_norm = 1.0
    opt = make(mode=mode, scale=4.0, clip_grad=max_norm)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    torch_opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    with opt:
        for i in range(3):
            grads = grads_for(i, 4.0 * (10.0 if i != 1 else 1e-4))  # clips in 0 and 2
            result = run_iteration(opt, grads, [None] * 3)
            for p, g in zip(params, grads):
                p.grad = g.float() / 4.0
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            torch_opt.step()
            assert result.clipped == (i != 1)
            assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    for s, p in enumerate(params):
        err = (opt.optimizer.master(s) - p.detach()).norm() / p.detach().norm()
        assert err < 1e-6


@pytest.mark.parametrize("norm", [0.5, 1.0 - 4e-7, 1.0, 1.0 + 1e-7, 3.0])
def test_clip_factor_is_torchs_and_megatrons_at_the_threshold(norm):
    """The coefficient max_norm / (norm + 1e-6) whenever it is below 1, as Megatron's
    clip_grad_by_total_norm_fp32 and torch's clip_grad_norm_ apply it: a norm at or just
    under --clip-grad is scaled by a hair too."""
    grad = torch.tensor([norm], dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([param], 1.0)
    assert clip_factor(norm, 1.0) == pytest.approx(float(param.grad / grad), rel=1e-15)
    assert clip_factor(norm, 0.0) == 1.0  # --clip-grad 0: no clipping


def test_bf16_and_fp32_training_without_scaling():
    for grad_dtype in (torch.bfloat16, torch.float32):
        adam = CPUAdamW([torch.ones(100)], lr=0.1, threads=1)
        out = torch.zeros(100, dtype=grad_dtype)
        with AsyncGroupOptimizer(adam, ConstantLossScaler()) as opt:
            opt.submit(0, torch.full((100,), 2.0, dtype=grad_dtype), out=out)
            result = opt.finish_iteration()
        assert result.loss_scale == 1.0 and result.grad_norm == pytest.approx(20.0)
        # first AdamW step moves every weight by lr (m_hat / sqrt(v_hat) = 1)
        assert torch.allclose(adam.master(0), torch.full((100,), 0.9))
        assert torch.equal(out, adam.master(0).to(grad_dtype))


def test_a_failed_group_task_changes_nothing_and_names_the_group():
    opt = make()
    outs = [torch.empty(n, dtype=torch.float16) for n in SIZES]
    with opt:
        run_iteration(opt, grads_for(0, 1.0), outs)
        before = snapshot(opt, outs)
        grads = grads_for(1, 1.0)

        def lost_gradient():
            raise OSError("gradient copy failed")

        opt.submit(0, grads[0], out=outs[0])
        opt.submit(1, grads[1], ready=lost_gradient, out=outs[1])
        opt.submit(2, grads[2], out=outs[2])
        with pytest.raises(GroupTaskError, match="group 1.*gradient copy failed"):
            opt.finish_iteration()
        assert same(snapshot(opt, outs), before, exact=True)
        assert not run_iteration(opt, grads, outs).skipped  # still usable


def test_bad_submission_fails_in_the_caller():
    with make() as opt:
        with pytest.raises(ValueError, match="grad has 4 elements; expected 5000"):
            opt.submit(0, torch.zeros(4))
        with pytest.raises(IndexError, match="group=7 out of range"):
            opt.submit(7, torch.zeros(4))
        opt.submit(0, torch.zeros(5000))
        with pytest.raises(ValueError, match="group 0 was already submitted"):
            opt.submit(0, torch.zeros(5000))
        with pytest.raises(ValueError, match="mode='eager'"):
            AsyncGroupOptimizer(opt.optimizer, opt.scaler, mode="eager")


def _rank_main(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(rank)
        adam = CPUAdamW([torch.randn(1000, generator=gen) for _ in range(2)], threads=1,
                        exact_rollback=True)
        before = [adam.master(s).clone() for s in range(2)]
        with AsyncGroupOptimizer(adam, DynamicLossScaler(2.0**8)) as opt:
            for group in (1, 0):
                g = torch.randn(1000, generator=gen).half()
                if rank == 1 and group == 0:
                    g[3] = float("nan")
                opt.submit(group, g)
            result = opt.finish_iteration()
        results[rank] = (result.skipped, result.rolled_back_groups, opt.scaler.scale,
                         all(torch.equal(adam.master(s), before[s]) for s in range(2)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc  # two processes over gloo
def test_overflow_on_one_rank_skips_the_iteration_on_all_ranks():
    with reserved_port() as port, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(port, results), nprocs=2, start_method="fork")
        results = dict(results)
    assert results[0] == (True, (0, 1), 2.0**7, True)
    assert results[1] == (True, (1,), 2.0**7, True)
