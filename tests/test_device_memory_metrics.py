"""The device-memory figures of the metrics: the runtime's book, and CUDA's caching-allocator
peak beside it, which the CPU device layer does not have (null, not 0)."""

import pytest
import torch
import torch.distributed as dist

from megatron.offload.device import MEMORY_CATEGORIES, DeviceLayer
from megatron.optimizer.group_optimizer import IterationResult
from megatron.pipeline.iteration_stats import IterationStats, pipeline_report


@pytest.fixture
def one_rank_group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0], backend="gloo")
    if started:
        dist.destroy_process_group()


def _report(peak, group):
    result = IterationResult(False, "speculative", 1.0, 1.0, (), (), False)
    stats = IterationStats(1.0, result, device_memory_peak_bytes=900,
                           device_memory_at_peak=dict.fromkeys(MEMORY_CATEGORIES, 0),
                           device_allocator_peak_bytes=peak)
    return pipeline_report(stats, 0, 1, True, group)[1]


def test_the_allocator_peak_is_null_where_the_layer_has_none(one_rank_group):
    with DeviceLayer("cpu") as layer:
        assert layer.allocator_peak_bytes() is None
        report = _report(layer.allocator_peak_bytes(), one_rank_group)
    assert report["device_allocator_peak_bytes"] is None
    assert report["per_rank"][0]["device_allocator_peak_bytes"] is None
    assert report["device_memory_peak_bytes"] == 900


def test_the_allocator_peak_is_reported_beside_the_book(one_rank_group):
    report = _report(12345, one_rank_group)
    assert report["device_allocator_peak_bytes"] == 12345
    assert report["per_rank"][0]["device_allocator_peak_bytes"] == 12345
    assert isinstance(report["device_allocator_peak_bytes"], int)


@pytest.mark.cuda
def test_the_cuda_layer_reads_its_allocators_peak():
    layer = DeviceLayer("cuda")
    layer.reset_peak_memory()
    kept = layer.empty(1 << 20, torch.float32)
    assert layer.allocator_peak_bytes() >= kept.nbytes
    assert layer.device_bytes >= kept.nbytes
