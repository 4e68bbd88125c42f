"""Rollback: the arithmetic inverse of AdamW within its documented bound, the snapshot
mode bit-exact (docs/cpu_optimizer.md, "Rollback error bound")."""

import itertools

import pytest
import torch

from megatron.optimizer import CPUAdamW

EPS32 = 2.0**-23
BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
BOUND_IN_EPS = 2.0  # the documented bound, in units of EPS32 times each term's scale


def state(opt):
    return [t.clone() for t in (opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0))]


def assert_within_bound(back, old, new, g, lr, wd, t):
    """|x_back - x_old| <= 2 eps (scale of the terms the inverse combines) + 2^-149."""
    back, old, new = ([x.double() for x in xs] for xs in (back, old, new))
    g = g.double()
    denom = new[2].sqrt() / (1 - BETA2**t) ** 0.5 + ADAM_EPS
    scales = (
        (new[0].abs() + lr / (1 - BETA1**t) * new[1].abs() / denom) / (1 - lr * wd),
        (new[1].abs() + (1 - BETA1) * g.abs()) / BETA1,
        (new[2] + (1 - BETA2) * g * g) / BETA2,
    )
    for name, b, o, s in zip(("p", "m", "v"), back, old, scales):
        excess = (b - o).abs() - (BOUND_IN_EPS * EPS32 * s + 2.0**-149)
        assert excess.max().item() <= 0.0, name


@pytest.mark.parametrize(
    "lr,grad_scale,param_scale,weight_decay",
    list(itertools.product([1e-4, 1e-2, 1.0], [1e-12, 1.0, 1e4], [1e-3, 1e3], [0.0, 0.1])),
)
def test_step_then_rollback_restores_within_bound(lr, grad_scale, param_scale, weight_decay):
    n = 4099
    gen = torch.Generator().manual_seed(0)
    opt = CPUAdamW([torch.randn(n, generator=gen) * param_scale], lr=lr,
                   weight_decay=weight_decay, threads=1)
    spread = torch.logspace(-3, 3, n)[torch.randperm(n, generator=gen)]
    for _ in range(6):  # a history with mixed magnitudes, so v is tiny in places
        opt.step_group(0, torch.randn(n, generator=gen) * grad_scale * spread)
    g = torch.randn(n, generator=gen) * grad_scale
    old = state(opt)
    assert opt.step_group(0, g).updated
    new = state(opt)
    opt.rollback_group(0)
    assert_within_bound(state(opt), old, new, g, lr, weight_decay, t=7)
    assert opt.step_count(0) == 6


def test_rollback_of_a_16bit_gradient_also_restores_the_working_copy():
    n = 3001
    gen = torch.Generator().manual_seed(1)
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=1e-2, weight_decay=0.1, threads=2)
    out = torch.empty(n, dtype=torch.bfloat16)
    opt.step_group(0, torch.randn(n, generator=gen).half(), inv_scale=1 / 8, out=out)
    old, old_out = state(opt), out.clone()
    g = torch.randn(n, generator=gen).half()
    opt.step_group(0, g, inv_scale=1 / 8, out=out)
    new = state(opt)
    opt.rollback_group(0)
    assert_within_bound(state(opt), old, new, g.float() / 8, 1e-2, 0.1, t=2)
    assert torch.equal(out, opt.master(0).bfloat16())
    assert (out.float() - old_out.float()).abs().max() <= old_out.float().abs().max() * 2**-7


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_is_bit_exact_over_many_steps(grad_dtype):
    n = 70_001
    gen = torch.Generator().manual_seed(2)
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=0.5, weight_decay=0.1, threads=2,
                   exact_rollback=True)
    out = torch.empty(n, dtype=torch.float16)
    for k in range(5):
        g = (torch.randn(n, generator=gen) * 10.0**k).to(grad_dtype)
        old, old_out = state(opt), out.clone()
        opt.step_group(0, g, out=out)
        opt.rollback_group(0)
        assert all(torch.equal(a, b) for a, b in zip(state(opt), old))
        if k:  # before the first step `out` held no copy of p yet
            assert torch.equal(out, old_out)
        opt.step_group(0, g, out=out)  # keep going from the restored state
        opt.commit_group(0)


def test_non_finite_gradient_without_snapshot_is_undone_within_bound():
    n = 70_001
    gen = torch.Generator().manual_seed(5)
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=1e-3, threads=2)
    opt.step_group(0, torch.randn(n, generator=gen))
    old = state(opt)
    g = torch.randn(n, generator=gen)
    g[-1] = float("nan")  # found last: the first thread's tiles were already updated
    assert not opt.step_group(0, g).updated
    # the inverse undid exactly the tiles that changed: compare with the forward step
    probe = CPUAdamW([old[0]], lr=1e-3, threads=1)
    probe.load_state_dict({"groups": [{"master": old[0], "exp_avg": old[1],
                                       "exp_avg_sq": old[2], "step": 1}]})
    probe.step_group(0, torch.nan_to_num(g))
    assert_within_bound(state(opt), old, state(probe), torch.nan_to_num(g), 1e-3, 0.0, t=2)
    assert opt.step_count(0) == 1


def test_inverse_clamps_v_at_zero_and_keeps_non_finite_values():
    n = 64
    opt = CPUAdamW([torch.ones(n)], lr=1e-3, threads=1)
    g = torch.ones(n)
    opt.step_group(0, g)
    opt.exp_avg_sq(0)[:8] = 0.0  # smaller than (1 - beta2) g^2: the inverse goes negative
    opt.master(0)[8] = float("inf")
    opt.exp_avg(0)[9] = float("nan")
    opt.exp_avg_sq(0)[10] = float("inf")
    opt.rollback_group(0)
    v = opt.exp_avg_sq(0)
    assert torch.equal(v[:8], torch.zeros(8))
    assert opt.master(0)[8].item() == float("inf")
    assert torch.isnan(opt.exp_avg(0)[9])
    assert v[10].item() == float("inf")
    assert (v >= 0).all()


def test_rollback_without_update_is_an_error():
    opt = CPUAdamW([torch.ones(10)], threads=1)
    with pytest.raises(RuntimeError, match="group 0 has no update"):
        opt.rollback_group(0)
    opt.step_group(0, torch.ones(10))
    opt.rollback_group(0)
    with pytest.raises(RuntimeError, match="group 0 has no update"):
        opt.rollback_group(0)
