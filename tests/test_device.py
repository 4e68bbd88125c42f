"""The device layer on the CPU: stream order, cross-stream events, errors, timestamps, threads."""

import threading

import pytest
import torch

from megatron.offload.device import CopyError, DeviceLayer, get_device


def copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("copy-stream-")]


def test_copies_on_one_stream_run_in_submission_order():
    with DeviceLayer("cpu") as dev:
        src = torch.randn(1 << 20)
        mid, dst = torch.empty_like(src), torch.empty_like(src)
        dev.copy_async(mid, src, dev.h2d_stream)
        done = dev.copy_async(dst, mid, dev.h2d_stream)  # reads what the first copy wrote
        done.wait()
        assert torch.equal(dst, src)


def test_stream_waits_on_event_of_another_stream_without_blocking_the_caller():
    with DeviceLayer("cpu") as dev:
        gate = threading.Event()
        dev.d2h_stream.submit(gate.wait)  # the d2h stream is busy until the gate opens
        d2h_done = dev.d2h_stream.record_event()
        dev.h2d_stream.wait_event(d2h_done)
        src, dst = torch.ones(1000), torch.zeros(1000)
        copied = dev.copy_async(dst, src, dev.h2d_stream)
        # the caller is not blocked: it gets here while the copy is still held back
        assert not copied.query() and not d2h_done.query()
        assert torch.count_nonzero(dst) == 0
        gate.set()
        copied.wait()
        assert torch.equal(dst, src)
        assert d2h_done.time_s() <= copied.time_s()


def test_compute_stream_is_synchronous_and_events_carry_increasing_times():
    with DeviceLayer("cpu") as dev:
        first = dev.compute_stream.record_event()
        assert first.query()  # compute runs on the caller's thread: already complete
        torch.randn(256, 256) @ torch.randn(256, 256)
        second = dev.compute_stream.record_event()
        assert 0.0 <= first.time_s() <= second.time_s()


def test_failed_copy_is_reported_by_the_next_event():
    with DeviceLayer("cpu") as dev:
        dev.h2d_stream.submit(lambda: torch.empty(3).copy_(torch.empty(4)))
        with pytest.raises(CopyError, match="copy before this event failed"):
            dev.h2d_stream.record_event().wait()


def test_copy_of_mismatched_sizes_is_refused_up_front():
    with DeviceLayer("cpu") as dev, pytest.raises(ValueError, match="4 elements into a 3"):
        dev.copy_async(torch.empty(3), torch.empty(4), dev.h2d_stream)


def test_close_stops_the_copy_threads():
    before = copy_threads()
    dev = DeviceLayer("cpu")
    dev.copy_async(torch.empty(10), torch.ones(10), dev.h2d_stream)
    dev.copy_async(torch.empty(10), torch.ones(10), dev.d2h_stream)
    assert len(copy_threads()) == len(before) + 2
    dev.close()
    assert copy_threads() == before


def test_bad_kind_is_rejected():
    with pytest.raises(ValueError, match="kind='tpu'"):
        get_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        get_device("cuda")


@pytest.mark.cuda
def test_bind_current_thread_gives_a_new_thread_the_layers_device():
    index = torch.cuda.device_count() - 1  # not the default device 0 where there are several
    layer = DeviceLayer("cuda", index)
    seen = []

    def worker() -> None:
        layer.bind_current_thread()
        seen.append(torch.cuda.current_device())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [index]
