"""Gradient offload to pooled host buffers, and the pinned pool's bounds and fallback."""

import threading
import warnings

import pytest
import torch
from torch import nn

from megatron.offload import host_memory
from megatron.offload.device import get_device
from megatron.offload.grad_buffers import GradientBuffers
from megatron.offload.grad_offload import GradientOffloader
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.layout import FlatLayout, bind_gradients


def _stage_and_reference() -> tuple[nn.Module, nn.Module, FlatLayout]:
    """A small bf16 stage, an independent copy of it (its gradients torch's own) and the
    stage's flat layout."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).bfloat16()
    reference = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).bfloat16()
    reference.load_state_dict(stage.state_dict())
    return stage, reference, FlatLayout.from_module(stage)


@pytest.mark.parametrize("host_dtype", [torch.float32, torch.bfloat16])
def test_accumulated_stage_gradients_reach_the_host_for_the_optimizer_thread(host_dtype):
    stage, reference, layout = _stage_and_reference()
    with get_device("cpu") as dev:
        pool = HostBufferPool(dev, capacity_bytes=4 * layout.numel)
        offloader = GradientOffloader(dev, pool, host_dtype=host_dtype)
        device_grads = dev.zeros(layout.numel, torch.bfloat16)
        bind_gradients(stage, layout, device_grads)
        for _ in range(3):  # micro-batches accumulate on the device
            x = torch.randn(4, 32, dtype=torch.bfloat16)
            stage(x).float().square().sum().backward()
            reference(x).float().square().sum().backward()
        ready = offloader.offload((1, 0), device_grads)
        seen = {}
        optimizer_task = threading.Thread(target=lambda: (ready.wait(), seen.update(h=ready.host)))
        optimizer_task.start()
        optimizer_task.join(timeout=30)
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert seen["h"].dtype == host_dtype
        assert torch.equal(seen["h"], expected.to(host_dtype))  # the upcast is exact
        ready.release()
        assert pool.in_use == 0


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_micro_batch_gradients_are_summed_in_the_main_gradients_dtype(kind, main_dtype):
    """As Megatron-LM sums its main gradients: each micro-batch's bf16 gradients (autograd's,
    per micro-batch) added into an fp32 sum; or, with bf16 main gradients, summed in bf16 in
    place. Against torch's own gradients of each micro-batch, summed by hand in that dtype,
    bit for bit; the fp32 sum is nearer the exact (float64) sum than the bf16 one. The
    device layer holds what it books: the sums, the micro-batch's buffer and the scratch
    the addition widens through."""
    stage, reference, layout = _stage_and_reference()
    inputs = [torch.randn(4, 32, dtype=torch.bfloat16) for _ in range(16)]
    with get_device(kind) as dev:
        stage.to(dev.torch_device)
        # widened through a scratch of 1000 elements: the stage's 2632 in 3 chunks, the
        # last one short
        buffers = GradientBuffers(dev, layout.numel, main_dtype, 1,
                                  working_dtype=torch.bfloat16, widen_chunk=1000)
        assert layout.numel % 1000 and layout.numel > 2000
        assert buffers.nbytes == layout.numel * main_dtype.itemsize + (
            layout.numel * 2 + 1000 * 4 if main_dtype != torch.bfloat16 else 0)
        total = buffers.acquire(layout.numel)
        for x in inputs:
            micro_batch = buffers.micro_batch_gradients(total)
            assert (micro_batch is total) == (main_dtype == torch.bfloat16)
            bind_gradients(stage, layout, micro_batch)
            stage(x.to(dev.torch_device)).float().square().sum().backward()
            buffers.accumulate(total, micro_batch)
        summed = total.cpu()
        assert dev.device_bytes == buffers.nbytes
    by_hand = torch.zeros(layout.numel, dtype=main_dtype)
    exact = torch.zeros(layout.numel, dtype=torch.float64)
    for x in inputs:
        reference.zero_grad(set_to_none=True)
        reference(x).float().square().sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        by_hand += grads.to(main_dtype)
        exact += grads.double()
    if kind == "cpu":  # the same kernels: the same bits
        assert torch.equal(summed, by_hand)
    error = (summed.double() - exact).norm() / exact.norm()
    assert error < (1e-6 if main_dtype == torch.float32 else 1e-1), float(error)
    if main_dtype == torch.bfloat16:  # 16 bf16 additions round: far from the fp32 sum
        assert error > 1e-4, float(error)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_buffers_are_reused_and_the_upcast_scratch_is_not_overwritten_early(kind):
    with get_device(kind) as dev:
        pool = HostBufferPool(dev, capacity_bytes=2 * 4 * (1 << 20))
        offloader = GradientOffloader(dev, pool, host_dtype=torch.float32)
        grads = [torch.randn(1 << 20).bfloat16() for _ in range(2)]
        on_device = [g.to(dev.torch_device) for g in grads]
        first = offloader.offload((0, 0), on_device[0])
        second = offloader.offload((0, 1), on_device[1])  # reuses the scratch of `first`
        first.wait()
        second.wait()
        assert first.host.is_pinned() == (kind == "cuda") == pool.pinned
        assert torch.equal(first.host, grads[0].float())
        assert torch.equal(second.host, grads[1].float())
        kept = first.host.data_ptr()
        first.release()
        third = offloader.offload((0, 0), on_device[1])
        assert third.host.data_ptr() == kept and pool.allocated_bytes == 2 * 4 * (1 << 20)
        with pytest.raises(MemoryError, match=r"capacity_bytes=8388608, 8388608 allocated"):
            offloader.offload((0, 2), on_device[0])
        second.release()
        third.release()


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_upcast_goes_through_one_chunk_of_device_memory(kind):
    """Stages larger than the upcast chunk (and not a multiple of it), offloaded back to
    back: each lands exact, through a scratch of one chunk."""
    chunk = 1000
    with get_device(kind) as dev:
        pool = HostBufferPool(dev, capacity_bytes=4 * (2500 + 3001))
        offloader = GradientOffloader(dev, pool, host_dtype=torch.float32, upcast_chunk=chunk)
        grads = [torch.randn(n).bfloat16() for n in (2500, 3001)]
        ready = [offloader.offload((0, i), g.to(dev.torch_device)) for i, g in enumerate(grads)]
        for landed, g in zip(ready, grads):
            landed.wait()
            assert torch.equal(landed.host, g.float())
            landed.release()
        assert offloader.scratch_nbytes == 4 * chunk


def test_failed_pinning_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    monkeypatch.setattr(host_memory, "_warned_pin_failure", False)

    def pin_fails(numel, dtype):
        raise RuntimeError("cudaHostAlloc: out of memory")

    with get_device("cpu") as dev:
        pools = [HostBufferPool(dev, 1 << 20, pin_fn=pin_fails) for _ in range(2)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buffers = [pool.acquire(1000, torch.float32) for pool in pools for _ in range(2)]
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "memlock limit is" in messages[0]
        assert "Falling back to pageable host memory" in messages[0]
        assert not any(pool.pinned for pool in pools)
        for buf in buffers:
            buf.fill_(1.0)  # usable memory
        assert len({b.data_ptr() for b in buffers}) == 4


def test_pool_pins_through_the_device_and_rejects_foreign_buffers():
    pinned_calls = []

    def pin(numel, dtype):
        pinned_calls.append(numel)
        return torch.empty(numel, dtype=dtype)

    with get_device("cpu") as dev:
        pool = HostBufferPool(dev, 1 << 20, pin_fn=pin)
        buf = pool.acquire(256, torch.float16)
        pool.release(buf)
        assert pool.acquire(256, torch.float16).data_ptr() == buf.data_ptr()
        assert pinned_calls == [256] and pool.pinned
        with pytest.raises(ValueError, match="did not hand out"):
            pool.release(torch.empty(256, dtype=torch.float16))
        with pytest.raises(ValueError, match="capacity_bytes=0"):
            HostBufferPool(dev, 0)
        with pytest.raises(ValueError, match="host_dtype=torch.int32"):
            GradientOffloader(dev, pool, host_dtype=torch.int32)


def test_default_host_dtype_is_the_measured_choice_per_device():
    with get_device("cpu") as dev:
        pool = HostBufferPool(dev, 1 << 20)
        assert GradientOffloader(dev, pool, training_dtype=torch.float16).host_dtype == (
            torch.float16
        )
        assert GradientOffloader(dev, pool, host_dtype=torch.float32).host_dtype == torch.float32
