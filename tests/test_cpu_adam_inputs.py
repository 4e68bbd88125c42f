"""Bad input gets a one-line error naming the argument; pinning and the bench CLI."""

import os

import pytest
import torch

from megatron.optimizer import CPUAdamW, check_gradient
from megatron.optimizer.cpu_adam import usable_cores
from tests import forked_ranks


@pytest.fixture
def opt():
    return CPUAdamW([torch.zeros(10)], threads=1)


@pytest.mark.parametrize(
    "grad,match",
    [
        (torch.zeros(10, dtype=torch.float64), "grad has dtype torch.float64"),
        (torch.zeros(11), "grad has 11 elements; expected 10"),
        (torch.zeros(20)[::2], "grad must be contiguous"),
        ([0.0] * 10, "grad must be a torch.Tensor"),
    ],
)
def test_bad_gradient(opt, grad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step_group(0, grad)


def test_bad_working_copy_scale_and_group(opt):
    with pytest.raises(ValueError, match="out has dtype torch.int8"):
        opt.step_group(0, torch.zeros(10), out=torch.zeros(10, dtype=torch.int8))
    with pytest.raises(ValueError, match="inv_scale=0.0 must be > 0"):
        opt.step_group(0, torch.zeros(10), inv_scale=0.0)
    with pytest.raises(IndexError, match="group=3 out of range"):
        opt.step_group(3, torch.zeros(10))
    opt.weight_decay, opt.lr = 2.0, 0.5
    with pytest.raises(ValueError, match=r"lr\*weight_decay=1.0 for group 0 must lie in \[0, 1\)"):
        opt.step_group(0, torch.zeros(10))
    assert opt.step_count(0) == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"isa": "sse9"}, "isa='sse9' is not available"),
        ({"threads": 0}, "threads=0 must be >= 1"),
        ({"cores": [10_000]}, r"cores=\[10000\]: \[10000\] not usable"),
        ({"betas": (0.0, 0.999)}, "betas\\[0\\]=0.0 makes the step irreversible"),
        ({"eps": 0.0}, "eps=0.0 must be > 0"),
        ({"weight_decay_mults": [1.0, 0.0]}, "weight_decay_mults=\\[1.0, 0.0\\]: expected one"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdamW([torch.zeros(4)], **kwargs)


def test_pinned_threads_give_the_same_result_and_leave_the_caller_unpinned():
    n = 70_001
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    cores = usable_cores()
    affinity_before = os.sched_getaffinity(0)
    pinned = CPUAdamW([p0], threads=2, cores=cores[:1])
    free = CPUAdamW([p0], threads=2)
    pinned.step_group(0, g)
    free.step_group(0, g)
    assert torch.equal(pinned.master(0), free.master(0))
    assert os.sched_getaffinity(0) == affinity_before


def test_empty_group_is_a_valid_no_op():
    opt = CPUAdamW([torch.zeros(0)], threads=2, cores=usable_cores()[:1])
    assert opt.step_group(0, torch.zeros(0)).updated
    opt.rollback_group(0)


def test_check_gradient_rejects_other_dtypes():
    with pytest.raises(ValueError, match="grad has dtype torch.int32"):
        check_gradient(torch.zeros(3, dtype=torch.int32))


@pytest.mark.multiproc  # runs the bench script in its own process
def test_bench_cli_exits_2_on_bad_input():
    # a fork of the session's preloaded zygote (tests/forked_ranks.py): `python
    # bench/cpu_adam.py` as __main__ with its exit status, without a second torch import
    proc = forked_ranks.launch("bench/cpu_adam.py", ["--params", "0"], timeout=60)
    assert proc.returncode == 2
    assert "argument --params: 0 must be >= 1" in proc.stderr
