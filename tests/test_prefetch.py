"""Device double buffer: stages stream through two halves; prefetch overlaps compute."""

import pytest
import torch
from torch import nn

from megatron.offload.device import get_device
from megatron.offload.layout import FlatLayout, copy_parameters_into
from megatron.offload.prefetch import ParamSlots


def stage_modules(n: int) -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n)]


def test_stages_stream_through_two_halves_and_compute_like_the_resident_model():
    stages, reference = stage_modules(4), stage_modules(4)
    layouts = [FlatLayout.from_module(m) for m in stages]
    host = [torch.empty(lay.numel) for lay in layouts]  # the store's flat copies
    for module, layout, flat in zip(stages, layouts, host):
        copy_parameters_into(module, layout, flat)
    x = torch.randn(4, 16)
    with get_device("cpu") as dev:
        buf = ParamSlots(dev, budget_bytes=2 * layouts[0].nbytes, dtype=torch.float32)
        halves = [slot.flat.data_ptr() for slot in buf.slots]
        current = buf.prefetch((0, 0), host[0])
        y = x
        for i in range(4):
            following = buf.prefetch((i + 1, 0), host[i + 1]) if i + 1 < 4 else None
            buf.bind(current, stages[i], layouts[i])
            y = stages[i](y)
            buf.release(current)
            current = following
        # nothing was reallocated: both halves are the buffers created up front
        assert [slot.flat.data_ptr() for slot in buf.slots] == halves
    expected = x
    for module in reference:
        expected = module(expected)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_a_stage_larger_than_a_half_and_a_third_prefetch_are_refused():
    with get_device("cpu") as dev:
        buf = ParamSlots(dev, budget_bytes=2 * 100 * 4, dtype=torch.float32)
        with pytest.raises(ValueError, match=r"stage \(7, 1\) needs 404 bytes .* holds 400"):
            buf.prefetch((7, 1), torch.zeros(101))
        buf.prefetch((0, 0), torch.zeros(100))
        buf.prefetch((1, 0), torch.zeros(100))
        with pytest.raises(RuntimeError, match=r"all 2 slots hold stages \[\(0, 0\), \(1, 0\)\]"):
            buf.prefetch((2, 0), torch.zeros(100))
        with pytest.raises(ValueError, match="budget_bytes=2"):
            ParamSlots(dev, budget_bytes=2, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prefetch_of_the_next_stage_overlaps_compute_of_the_current(kind):
    """Overlap as an ordering: the copy of stage 1 starts before stage 0's compute ends and
    ends after it starts, so total time < copy time + compute time."""
    numel = 8 << 20  # 32 MB of fp32 per stage
    with get_device(kind) as dev:
        pin = dev.pins_memory
        sources = [torch.full((numel,), float(i), pin_memory=pin) for i in range(2)]
        buf = ParamSlots(dev, budget_bytes=2 * numel * 4, dtype=torch.float32)
        current = buf.prefetch((0, 0), sources[0])
        buf.wait_ready(current)
        copy_started = dev.h2d_stream.record_event()
        following = buf.prefetch((1, 0), sources[1])
        compute_started = dev.compute_stream.record_event()  # after the prefetch returned
        with dev.on(dev.compute_stream):
            w = current.params[: 512 * 512].view(512, 512)
            acc = torch.ones(512, 512, device=dev.torch_device)
            for _ in range(12):  # the artificial compute load
                acc = torch.tanh(acc @ w / 512)
        compute_ended = dev.compute_stream.record_event()
        copy_ended = following.ready
        assert copy_started.time_s() < compute_ended.time_s()
        assert compute_started.time_s() < copy_ended.time_s()
        buf.wait_ready(following)
        assert torch.equal(following.params.cpu(), sources[1])
        assert torch.isfinite(acc).all()
