"""The C++ AdamW kernel through CPUAdamW, against torch.optim.AdamW and closed forms."""

import pytest
import torch

from megatron.optimizer import CPUAdamW, available_isas, check_gradient

ISAS = available_isas()
LOW = {torch.float16, torch.bfloat16}
# Not multiples of the SIMD width (8, 16) nor of the tile (2048); the last one spans
# several tiles and two threads.
SIZES = [1, 13, 2048 + 37, 70_001]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def torch_adamw_run(p0, grads, lr, wd):
    """torch.optim.AdamW on the fp32 upcast of each gradient."""
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for g in grads:
        param.grad = g.float()
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_twenty_steps_match_torch_adamw(isa, n, grad_dtype, weight_decay):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 0.01).to(grad_dtype) for _ in range(20)]
    out_dtype = grad_dtype if grad_dtype in LOW else torch.bfloat16
    opt = CPUAdamW([p0], lr=1e-3, weight_decay=weight_decay, threads=2, isa=isa)
    out = torch.empty(n, dtype=out_dtype)
    for g in grads:
        assert opt.step_group(0, g, out=out).updated
    p, m, v = torch_adamw_run(p0, grads, 1e-3, weight_decay)
    assert rel_err(opt.master(0), p) < 1e-6
    assert rel_err(opt.exp_avg(0), m) < 1e-6
    assert rel_err(opt.exp_avg_sq(0), v) < 1e-6
    assert torch.equal(out, opt.master(0).to(out_dtype))  # torch's rounding of our result
    assert opt.step_count(0) == 20


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_working_copy_is_torch_rounding_of_master(out_dtype):
    n = 4099
    gen = torch.Generator().manual_seed(1)
    # magnitudes that exercise fp16 subnormals, rounding ties and bf16's wide range
    p0 = torch.randn(n, generator=gen) * torch.logspace(-7, 4, n)
    opt = CPUAdamW([p0], lr=1e-2, threads=1)
    out = torch.empty(n, dtype=out_dtype)
    opt.step_group(0, torch.randn(n, generator=gen), out=out)
    assert torch.equal(out, opt.master(0).to(out_dtype))


def test_every_isa_and_thread_count_gives_identical_bits():
    n = 100_003
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 3.0).to(torch.float16) for _ in range(3)]
    finals = []
    for isa in ISAS:
        for threads in (1, 2):
            opt = CPUAdamW([p0], lr=1e-3, weight_decay=0.1, threads=threads, isa=isa)
            out = torch.empty(n, dtype=torch.float16)
            for g in grads:
                opt.step_group(0, g, inv_scale=0.5, out=out)
            finals.append((isa, threads, opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0), out))
    for isa, threads, *tensors in finals[1:]:
        for a, b in zip(tensors, finals[0][2:]):
            assert torch.equal(a, b), (isa, threads)


def test_unscaling_and_sum_of_squares():
    n = 5001
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(n, generator=gen) * 1024).to(torch.bfloat16)
    p0 = torch.randn(n, generator=gen)
    opt = CPUAdamW([p0], lr=1e-3, threads=2)
    result = opt.step_group(0, g, inv_scale=1 / 1024)
    expected_sq = (g.double() / 1024).pow(2).sum().item()
    assert result.grad_sq_sum == pytest.approx(expected_sq, rel=1e-5)
    p, m, v = torch_adamw_run(p0, [g.float() / 1024], 1e-3, 0.0)
    assert rel_err(opt.master(0), p) < 1e-6 and rel_err(opt.exp_avg_sq(0), v) < 1e-6
    finite, sq = check_gradient(g, inv_scale=1 / 1024, threads=2)
    assert finite and sq == pytest.approx(expected_sq, rel=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 40_000, 70_000])
def test_non_finite_gradient_leaves_state_unchanged(isa, bad, where):
    n = 70_001  # two threads; `where` is in the first tile, mid-way, in the SIMD tail
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen)
    opt = CPUAdamW([p0], lr=1e-3, weight_decay=0.1, threads=2, exact_rollback=True, isa=isa)
    out = torch.empty(n, dtype=torch.bfloat16)
    opt.step_group(0, torch.randn(n, generator=gen).to(torch.bfloat16), out=out)
    before = [t.clone() for t in (opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0), out)]
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    g[where] = bad
    result = opt.step_group(0, g, out=out)
    assert not result.updated and result.grad_sq_sum == float("inf")
    for a, b in zip((opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0), out), before):
        assert torch.equal(a, b)
    assert opt.step_count(0) == 1
    assert not check_gradient(g, threads=2)[0]


@pytest.mark.parametrize("isa", ISAS)
def test_a_non_finite_gradient_leaves_the_same_bits_on_any_number_of_threads(isa):
    """Without a snapshot the tiles a failed step updated are put back by the inverse of
    AdamW, which rounds: the same bits every time need the same tiles updated whatever
    the threads and their timing. The first half's last tile is not finite: one thread
    reaches it after every tile before it, the second of two threads has meanwhile
    stepped most of its own half."""
    n = 400_003
    gen = torch.Generator().manual_seed(7)
    p0, g0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e3
    g[n // 2 - 5] = float("inf")
    states = []
    for threads in (1, 2, 2, 2, 2):
        opt = CPUAdamW([p0.clone()], lr=1e-2, weight_decay=0.1, threads=threads, isa=isa)
        opt.step_group(0, g0)
        assert not opt.step_group(0, g).updated
        states.append([t.clone() for t in (opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0))])
    for other in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(states[0], other))


def test_unscaled_overflow_counts_as_non_finite():
    g = torch.full((100,), 3e38)  # finite in fp32, inf once multiplied by 2
    assert check_gradient(g)[0]
    assert not check_gradient(g, inv_scale=2.0)[0]


def test_per_group_weight_decay_factor_matches_torch_param_groups():
    gen = torch.Generator().manual_seed(6)
    weights = [torch.randn(3000, generator=gen), torch.randn(500, generator=gen)]
    grads = [[torch.randn(w.numel(), generator=gen) for w in weights] for _ in range(5)]
    opt = CPUAdamW(weights, lr=1e-2, weight_decay=0.1, weight_decay_mults=[1.0, 0.0], threads=1)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = torch.optim.AdamW([{"params": [params[0]], "weight_decay": 0.1},
                             {"params": [params[1]], "weight_decay": 0.0}], lr=1e-2)
    for step_grads in grads:
        for group, g in enumerate(step_grads):
            opt.step_group(group, g)
            params[group].grad = g
        ref.step()
    for group, p in enumerate(params):
        assert rel_err(opt.master(group), p.detach()) < 1e-6
