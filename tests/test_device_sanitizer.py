"""The CPU device layer's stream sanitizer: an access that no event wait, stream wait or
synchronisation orders after a conflicting access on another stream raises at once, whatever
the CPU's timing; chaos delays copy streams without changing what correct code computes."""

import threading
import time

import pytest
import torch

from megatron.offload.device import CHAOS_ENV, SANITIZER_ENV, DeviceLayer
from megatron.offload.sanitizer import StreamRaceError


@pytest.fixture
def device():
    with DeviceLayer("cpu", sanitize=True) as layer:
        yield layer


def test_a_write_on_one_stream_then_a_read_on_another_without_a_wait_raises(device):
    src = device.pin_host(64, torch.float32, name="staging")
    slot = device.empty(64, torch.float32, name="slot")
    device.checks.at_instruction("rank 0 instruction 3: PREFETCH_PARAMS")
    device.copy_async(slot, src, device.h2d_stream)
    device.checks.at_instruction("rank 0 instruction 4: FORWARD")
    with pytest.raises(StreamRaceError) as raised:
        device.checks.kernel(device.compute_stream, reads=(slot,), what="forward")
    message = str(raised.value)
    # the buffer, both streams and both instructions
    assert "slot #2" in message
    assert "read on compute (forward; rank 0 instruction 4: FORWARD)" in message
    assert "write on h2d (copy on h2d; rank 0 instruction 3: PREFETCH_PARAMS)" in message
    assert device.sanitizer.error is raised.value


def test_with_wait_event_the_same_read_is_ordered(device):
    src = device.pin_host(64, torch.float32)
    slot = device.empty(64, torch.float32)
    ready = device.copy_async(slot, src, device.h2d_stream)
    device.compute_stream.wait_event(ready)
    device.checks.kernel(device.compute_stream, reads=(slot,))
    assert device.sanitizer.checked == 3 and device.sanitizer.error is None


def test_a_copy_into_a_buffer_still_read_by_compute_needs_the_release_event(device):
    """The double buffer's rule: a prefetch into a half waits for the compute that used it."""
    src = device.pin_host(64, torch.float32)
    slot = device.empty(64, torch.float32)
    device.checks.kernel(device.compute_stream, reads=(slot,), what="forward")
    with pytest.raises(StreamRaceError, match="write on h2d .* not ordered after the read on compute"):
        device.copy_async(slot, src, device.h2d_stream)
    device.h2d_stream.wait_event(device.compute_stream.record_event())
    device.copy_async(slot, src, device.h2d_stream)


def test_a_host_read_of_a_pinned_buffer_before_the_copys_event_raises(device):
    grads = device.zeros(64, torch.float32, stream=device.d2h_stream)
    host = device.pin_host(64, torch.float32, name="host gradients")
    done = device.copy_async(host, grads, device.d2h_stream)
    with pytest.raises(StreamRaceError, match="host gradients.*read on host thread"):
        device.checks.host_read(host, what="the optimizer")
    done.wait()
    device.checks.host_read(host, what="the optimizer")
    # the wait ordered this thread only: another host thread has not seen the event
    failed = []
    thread = threading.Thread(target=lambda: _catch(failed, device.checks.host_write, host))
    device.copy_async(host, grads, device.d2h_stream).wait()  # a second copy, waited here
    thread.start()
    thread.join()
    assert len(failed) == 1 and "write on host thread" in str(failed[0])


def _catch(failed, fn, *args):
    try:
        fn(*args)
    except StreamRaceError as exc:
        failed.append(exc)


def test_a_stream_synchronisation_orders_the_host(device):
    host = device.pin_host(8, torch.float32)
    device.copy_async(host, device.zeros(8, torch.float32, stream=device.d2h_stream), device.d2h_stream)
    device.wait_for(device.d2h_stream)
    device.checks.host_write(host)


def test_views_share_their_base_history(device):
    base = device.empty(100, torch.float32, name="gradient buffer")
    device.checks.kernel(device.compute_stream, writes=(base[10:20],), what="backward")
    host = device.pin_host(50, torch.float32)
    with pytest.raises(StreamRaceError, match="gradient buffer"):
        device.copy_async(host, base[50:], device.d2h_stream)  # another view of the same base


def test_an_event_orders_what_its_stream_waited_for_transitively(device):
    """compute waits for h2d; d2h waits for compute's event: d2h is after the h2d copy."""
    src = device.pin_host(8, torch.float32)
    buf = device.empty(8, torch.float32)
    device.compute_stream.wait_event(device.copy_async(buf, src, device.h2d_stream))
    device.d2h_stream.wait_event(device.compute_stream.record_event())
    device.copy_async(device.pin_host(8, torch.float32), buf, device.d2h_stream)
    assert device.sanitizer.error is None


def test_a_reused_address_starts_a_fresh_history(device):
    """A buffer handed out again may sit where a freed one was: it does not inherit the
    freed buffer's accesses."""
    buf = device.empty(1 << 12, torch.float32)
    device.copy_async(device.pin_host(1 << 12, torch.float32), buf, device.d2h_stream)
    device.d2h_stream.synchronize()
    address = buf.data_ptr()
    del buf
    again = device.empty(1 << 12, torch.float32)
    if again.data_ptr() != address:
        pytest.skip("the allocator did not reuse the address")
    device.checks.kernel(device.compute_stream, writes=(again,))
    assert device.sanitizer.error is None


def test_buffers_not_handed_out_by_the_layer_are_not_tracked(device):
    mine = torch.zeros(8)
    device.copy_async(mine, device.empty(8, torch.float32), device.d2h_stream)
    device.checks.host_read(mine)
    assert device.sanitizer.checked == 1  # only the device buffer the copy read


def test_the_environment_turns_the_sanitizer_and_chaos_on(monkeypatch):
    monkeypatch.setenv(SANITIZER_ENV, "1")
    monkeypatch.setenv(CHAOS_ENV, "5")
    with DeviceLayer("cpu") as layer:
        assert layer.sanitizer is not None and layer.chaos_seed == 5
    monkeypatch.delenv(SANITIZER_ENV)
    monkeypatch.delenv(CHAOS_ENV)
    with DeviceLayer("cpu") as layer:
        assert layer.sanitizer is None and layer.chaos_seed is None


def test_chaos_delays_copies_but_waited_results_are_exact():
    data = torch.arange(4096, dtype=torch.float32)
    with DeviceLayer("cpu", sanitize=True, chaos_seed=3) as layer:
        t0 = time.perf_counter()
        outs = []
        for _ in range(20):
            dev = layer.empty(4096, torch.float32)
            ready = layer.copy_async(dev, data, layer.h2d_stream)
            layer.compute_stream.wait_event(ready)
            host = layer.pin_host(4096, torch.float32)
            layer.d2h_stream.wait_event(layer.compute_stream.record_event())
            outs.append((host, layer.copy_async(host, dev, layer.d2h_stream)))
        for host, done in outs:
            done.wait()
            layer.checks.host_read(host)
            assert torch.equal(host, data)
        assert time.perf_counter() - t0 > 20 * 2 * 0.0002  # the copies were held back
