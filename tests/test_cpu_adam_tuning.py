"""The kernel's speed knobs (prefetch distance, streaming stores of the working copy, block
size, a static split of the blocks among the threads) change nothing but speed: every
setting gives the default's bits."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.optimizer import CPUAdamW, available_isas, kernel_tuning, kernel_tuning_setting

BF16 = torch.bfloat16
TUNINGS = [
    {"prefetch": 0},
    {"prefetch": 1024},
    {"stream_out": False},  # the default streams the working copy: the cached stores
    {"stream_out": False, "prefetch": 0},
    {"block": 64, "static_split": True},  # 626 blocks in two shares, the rest stolen
    {"block": 262144},
]
# (state_dtype, master_dtype); the last one rounds the master stochastically
PRECISIONS = [(torch.float32, torch.float32), (BF16, torch.float32), (BF16, BF16)]


def run(isa: str, state_dtype, master_dtype, out_dtype, offset: int, knobs: dict):
    """Three steps over 40_003 elements (several tiles and blocks, a SIMD tail); the working
    copy starts `offset` elements into its buffer, so an odd offset is never aligned."""
    n = 40_003
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 8).to(BF16) for _ in range(3)]
    opt = CPUAdamW([p0], lr=1e-2, weight_decay=0.1, threads=2, isa=isa,
                   state_dtype=state_dtype, master_dtype=master_dtype)
    out = torch.empty(n + offset, dtype=out_dtype)[offset:]
    with kernel_tuning(**knobs):
        for g in grads:
            assert opt.step_group(0, g, inv_scale=0.5, out=out).updated
    return [opt.master(0), opt.exp_avg(0), opt.exp_avg_sq(0), out]


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("state_dtype,master_dtype", PRECISIONS)
@pytest.mark.parametrize("out_dtype,offset", [(BF16, 0), (BF16, 1), (torch.float32, 0)])
def test_every_tuning_gives_the_default_bits(isa, state_dtype, master_dtype, out_dtype, offset):
    want = run(isa, state_dtype, master_dtype, out_dtype, offset, {})
    for knobs in TUNINGS:
        got = run(isa, state_dtype, master_dtype, out_dtype, offset, knobs)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32)), knobs


def test_tuning_is_restored_and_bad_values_are_refused_naming_them():
    before = kernel_tuning_setting()
    with kernel_tuning(prefetch=0, stream_out=True, block=4096, static_split=True) as inside:
        assert inside == {"prefetch": 0, "stream_out": True, "block": 4096, "static_split": True}
    assert kernel_tuning_setting() == before
    with pytest.raises(ValueError, match="block=100"), kernel_tuning(block=100):
        pass
    with pytest.raises(ValueError, match="prefetch=-1"), kernel_tuning(prefetch=-1):
        pass
    assert kernel_tuning_setting() == before


def test_a_bad_tuning_variable_stops_the_trainer_in_one_line():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, os.path.join(root, "pretrain_llama.py"), "--help"],
                         env={**os.environ, "CPU_ADAM_BLOCK": "100"}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "block=100" in err[0] and "CPU_ADAM_BLOCK" in err[0], err
