"""Clipping without a second pass: a speculative step made with a predicted clip factor is
replaced by the clipped step in one fused pass (docs/cpu_optimizer.md, "Clipping"),
checked against a reference that applies the clipped step directly."""

import itertools

import pytest
import torch

from megatron.optimizer import AsyncGroupOptimizer, ConstantLossScaler, CPUAdamW

EPS32 = 2.0**-23
BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8


def state(opt, group=0):
    return [t.clone() for t in (opt.master(group), opt.exp_avg(group), opt.exp_avg_sq(group))]


def twins(n, lr, wd, exact, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    return gen, [CPUAdamW([init], lr=lr, weight_decay=wd, threads=1, betas=(BETA1, BETA2),
                          eps=ADAM_EPS, exact_rollback=exact) for _ in range(2)]


def assert_within_correction_bound(got, want, spec, g_spec, lr, t):
    """The documented bound: |x - x_direct| <= 2 eps S_x + 2^-149 (see cpu_optimizer.md)."""
    got, want, spec = ([x.double() for x in xs] for xs in (got, want, spec))
    g_spec = g_spec.double()
    bc1, bc2 = 1 - BETA1**t, 1 - BETA2**t
    denom = want[2].sqrt() / bc2**0.5 + ADAM_EPS
    s_m = spec[1].abs() + (1 - BETA1) * g_spec.abs() + want[1].abs()
    s_v = spec[2] + (1 - BETA2) * g_spec**2 + want[2]
    spec_denom = spec[2].sqrt() / bc2**0.5 + ADAM_EPS
    s_p = (spec[0].abs() + want[0].abs() + lr / bc1 * spec[1].abs() / spec_denom
           + lr / bc1 * (s_m / denom + want[1].abs() * s_v / (2 * want[2].sqrt() * bc2**0.5
                                                             * denom**2 + 1e-300)))
    for name, a, b, s in zip("pmv", got, want, (s_p, s_m, s_v)):
        excess = (a - b).abs() - (2 * EPS32 * s + 2.0**-149)
        assert excess.max().item() <= 0.0, name


@pytest.mark.parametrize("lr,ratio,true_clip",
                         list(itertools.product([1e-4, 1e-2], [0.25, 1.0, 4.0, 1e4], [1e-4, 0.5])))
def test_fused_correction_equals_the_directly_clipped_step(lr, ratio, true_clip):
    """ratio: the speculative clip factor over the true one (1e4: no prediction at all)."""
    spec_clip = min(1.0, true_clip * ratio)
    n = 4099
    for exact in (False, True):
        gen, (spec, direct) = twins(n, lr, 0.1, exact)
        spread = torch.logspace(-3, 3, n)[torch.randperm(n, generator=gen)]
        for _ in range(5):  # a history: moments of mixed magnitudes
            g = torch.randn(n, generator=gen) * spread
            spec.step_group(0, g, clip=true_clip)
            direct.step_group(0, g, clip=true_clip)
        g = torch.randn(n, generator=gen) * spread
        out_spec, out_direct = (torch.empty(n, dtype=torch.bfloat16) for _ in range(2))
        spec.step_group(0, g, clip=spec_clip, out=out_spec)
        speculative = state(spec)
        spec.correct_group(0, true_clip)
        direct.step_group(0, g, clip=true_clip, out=out_direct)
        if exact:  # pre-step state from the snapshot: the same bits as the direct step
            for a, b in zip(state(spec), state(direct)):
                assert torch.equal(a, b)
            assert torch.equal(out_spec, out_direct)
        else:
            g_spec = g * torch.tensor(spec_clip, dtype=torch.float32)
            assert_within_correction_bound(state(spec), state(direct), speculative, g_spec, lr, 6)
            assert torch.equal(out_spec, spec.master(0).to(torch.bfloat16))
        # the corrected step is the one a rollback now undoes
        spec.rollback_group(0)
        assert spec.step_count(0) == 5


def run_iterations(mode, exact, grads, clip_grad):
    adam = CPUAdamW([torch.zeros(g.numel()) + 0.5 for g in grads[0]], lr=1e-2, weight_decay=0.1,
                    threads=1, exact_rollback=exact)
    results = []
    with AsyncGroupOptimizer(adam, ConstantLossScaler(), mode=mode, clip_grad=clip_grad) as opt:
        for iteration in grads:
            for group, g in enumerate(iteration):
                opt.submit(group, g)
            results.append(opt.finish_iteration())
    return [state(adam, g) for g in range(adam.num_groups)], results


@pytest.mark.parametrize("exact", [False, True])
def test_strong_clipping_in_every_iteration_matches_the_directly_clipped_steps(exact):
    """--clip-grad 1e-3: every iteration clips. The speculative run ("async") corrects
    each step; the reference ("sync") applies the clipped step directly."""
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(5000, generator=gen) * (1 + 0.3 * i) for _ in range(2)]
             for i in range(6)]
    grads[3] = [g * 5 for g in grads[3]]  # a jump of the norm: the prediction is 5x off
    ours, results = run_iterations("async", exact, grads, 1e-3)
    reference, ref_results = run_iterations("sync", exact, grads, 1e-3)
    assert all(r.clipped for r in results)
    assert all(r.corrected_groups == (0, 1) for r in results)
    assert [r.grad_norm for r in results] == pytest.approx([r.grad_norm for r in ref_results],
                                                           rel=1e-12)
    for group_ours, group_ref in zip(ours, reference):
        for a, b in zip(group_ours, group_ref):
            if exact:
                assert torch.equal(a, b)
            else:
                assert ((a - b).norm() / b.norm()).item() < 1e-6


def test_deferred_corrections_run_in_the_given_order_and_the_next_step_waits():
    gen = torch.Generator().manual_seed(4)
    adam = CPUAdamW([torch.randn(3000, generator=gen) for _ in range(3)], lr=1e-2, threads=1)
    done = []
    with AsyncGroupOptimizer(adam, ConstantLossScaler(), clip_grad=1e-3, max_workers=1) as opt:
        grads = [torch.randn(3000, generator=gen) for _ in range(3)]
        for group, g in enumerate(grads):
            opt.submit(group, g)
        opt.wait_all()
        opt.synchronize()
        futures = opt.correct_deferred([((2,), lambda: done.append(2)),
                                        ((0, 1), lambda: done.append(0))])
        result = opt.end_iteration()
        assert result.corrected_groups == (0, 1, 2) and all(f is not None for f in futures)
        for group, g in enumerate(grads):  # waits for the group's correction first
            opt.submit(group, g)
        opt.wait_all()
        assert done == [2, 0]
        opt.synchronize()
        opt.correct()
        opt.end_iteration()
        assert all(adam.step_count(g) == 2 for g in range(3))


def test_an_optimizer_resumed_from_its_state_continues_bit_for_bit():
    """What a checkpoint must hold: after 3 of 6 clipped iterations, a new optimizer loaded
    with CPUAdamW's state and the speculation state (the predicted clip factor) continues
    with the uninterrupted run's bits. Without the prediction its first speculative step
    assumes no clipping, and the correction by the inverse lands elsewhere."""
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(5000, generator=gen) * (1 + 0.2 * i) for _ in range(2)]
             for i in range(6)]

    def optimizer():
        adam = CPUAdamW([torch.zeros(5000) + 0.5 for _ in range(2)], lr=1e-2,
                        weight_decay=0.1, threads=1)
        return adam, AsyncGroupOptimizer(adam, ConstantLossScaler(), clip_grad=1e-3)

    def train(opt, iterations):
        for iteration in iterations:
            for group, g in enumerate(iteration):
                opt.submit(group, g)
            assert opt.finish_iteration().corrected_groups == (0, 1)

    adam, opt = optimizer()
    with opt:
        train(opt, grads[:3])
        saved = {"groups": [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()}
                            for g in adam.state_dict()["groups"]]}
        speculation = opt.state_dict()
        train(opt, grads[3:])
    uninterrupted = [state(adam, g) for g in range(2)]
    assert 0.0 < speculation["predicted_clip"] < 1e-3
    for restored in (speculation, None):
        adam, opt = optimizer()
        with opt:
            adam.load_state_dict(saved)
            if restored is not None:
                opt.load_state_dict(restored)
            train(opt, grads[3:])
        same = all(torch.equal(a, b) for group, want in zip(range(2), uninterrupted)
                   for a, b in zip(state(adam, group), want))
        assert same == (restored is not None)
