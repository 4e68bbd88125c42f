"""Lifetimes on the device layer: a tensor a stream's work touches stays allocated until that
work is done. On CUDA the stream keeps what each operation declares (KeepAlive); on the CPU
the sanitizer fails whatever would break that: an operation touching a buffer it did not
declare, an owner giving a buffer back before it waited for the streams' work on it, a
zero-fill on the caller's stream that another stream does not wait for."""

import gc
import threading
import weakref

import pytest
import torch

from megatron.offload.device import CopyError, DeviceLayer, KeepAlive
from megatron.offload.sanitizer import StreamRaceError
from megatron.optimizer.subgroups import AdamHyper, adam_step_torch
from megatron.pipeline.subgroup_device import SUBGROUP_BOOK, ResidentSubgroupUpdater

HYPER = AdamHyper(inv_scale=1.0, clip=1.0, decay=0.999, one_minus_b1=0.1, beta2=0.999,
                  one_minus_b2=0.001, inv_bc2_sqrt=1.0, eps=1e-8, neg_step=-1e-3)


@pytest.fixture
def device():
    with DeviceLayer("cpu", sanitize=True) as layer:
        yield layer


def test_keep_alive_holds_a_dropped_tensor_until_the_work_after_it_is_done():
    """What CudaStream.submit does with every launch, driven by CPU events."""
    with DeviceLayer("cpu") as layer:
        gate = threading.Event()
        layer.d2h_stream.submit(gate.wait)  # the stream is busy until the gate opens
        keep = KeepAlive()
        buffer = torch.empty(1 << 10)
        alive = weakref.ref(buffer)
        keep.hold(layer.d2h_stream.record_event(), (buffer,))
        del buffer  # the owner lets go while the stream has not run the work
        gc.collect()
        keep.release_done()
        assert alive() is not None and keep.held == 1
        gate.set()
        layer.d2h_stream.synchronize()
        keep.hold(layer.d2h_stream.record_event(), ())  # a later launch finds it done
        assert alive() is None and keep.held == 0


def test_an_operation_touching_a_buffer_it_does_not_declare_fails(device):
    declared = device.empty(16, torch.float32, name="declared")
    hidden = device.empty(16, torch.float32, name="hidden scratch")
    device.h2d_stream.submit(lambda: declared.copy_(hidden), writes=(declared,),
                             what="a copy declaring only its destination")
    with pytest.raises(CopyError, match="undeclared access on hidden scratch"):
        device.h2d_stream.synchronize()
    assert "would not keep it alive" in str(device.sanitizer.error)


def test_a_written_buffer_declared_as_read_fails(device):
    target = device.empty(16, torch.float32, name="target")
    device.h2d_stream.submit(lambda: target.fill_(1.0), reads=(target,), what="a fill")
    with pytest.raises(CopyError, match="target .* writes it"):
        device.h2d_stream.synchronize()


def test_a_declared_operation_passes_once_checked_per_kind(device):
    src, dst = device.empty(16, torch.float32), device.empty(16, torch.float32)
    for _ in range(3):
        device.d2h_stream.submit(lambda: dst.copy_(src), reads=(src,), writes=(dst,),
                                 what="a declared copy")
    device.d2h_stream.synchronize()
    assert device.sanitizer.error is None


def test_giving_a_buffer_back_needs_the_owners_own_wait(device):
    """A pooled host buffer goes back to the pool only once the thread returning it has
    waited for the copy into it: another thread's wait, joined, is not the owner's."""
    grads = device.empty(64, torch.float32)
    host = device.pin_host(64, torch.float32, name="host gradients")
    copied = device.copy_async(host, grads, device.d2h_stream)
    with pytest.raises(StreamRaceError, match="host gradients #2 .*: freed by host thread "
                                              "'MainThread'.*before it waited for the write on d2h"):
        device.checks.host_free(host, what="back to the pool")
    reader = threading.Thread(target=copied.wait)
    reader.start()
    reader.join()
    device.checks.host_threads_joined()
    with pytest.raises(StreamRaceError, match="freed by"):
        device.checks.host_free(host)
    copied.wait()
    device.checks.host_free(host)
    # given back, it is a fresh buffer: a new copy into it is ordered by its stream
    device.copy_async(host, grads, device.d2h_stream).wait()
    # a reader's work (a device subgroup loading the gradient) is waited for by the
    # reader's thread
    loaded = device.copy_async(device.empty(64, torch.float32), host, device.h2d_stream)
    with pytest.raises(StreamRaceError, match="before it waited for the read on h2d"):
        device.checks.host_free(host)
    reader = threading.Thread(target=loaded.wait)
    reader.start()
    reader.join()
    device.checks.host_free(host)


def test_a_zero_fill_is_a_write_on_the_allocating_stream(device):
    flags = device.zeros(2, torch.float64, name="flags")  # on the compute stream
    with pytest.raises(StreamRaceError, match="write on compute \\(zero-filling"):
        device.copy_async(device.pin_host(2, torch.float64), flags, device.d2h_stream)
    on_d2h = device.zeros(2, torch.float64, stream=device.d2h_stream)
    device.copy_async(device.pin_host(2, torch.float64), on_d2h, device.d2h_stream).wait()


def test_device_bytes_count_the_live_device_buffers_only(device):
    before = device.device_bytes
    kept = device.empty(100, torch.float32)
    dropped = device.zeros(50, torch.float64, stream=device.h2d_stream)
    device.pin_host(1000, torch.float32)  # host memory: not device bytes
    assert device.device_bytes == before + 400 + 400
    del dropped
    assert device.device_bytes == before + kept.nbytes


def test_a_book_and_the_total_change_together_whichever_thread_frees(device):
    """What the executor's memory check reads while optimizer threads allocate and free:
    a buffer's book and the layer's total at one instant."""
    plain = device.empty(10, torch.float32)
    booked = [device.empty(25, torch.float32, book="mine") for _ in range(2)]
    assert device.device_snapshot() == (device.device_bytes, {"mine": 200})
    freer = threading.Thread(target=booked.pop)  # the last reference goes on another thread
    freer.start()
    freer.join()
    assert device.device_snapshot() == (device.device_bytes, {"mine": 100})
    assert device.device_bytes - 100 >= plain.nbytes
    booked.clear()
    assert device.device_snapshot()[1] == {"mine": 0}


def test_resident_subgroups_under_the_sanitizer_step_like_the_kernel(device):
    """Its flags are written by the step on the update stream (a zero-fill on the caller's
    stream would race with it), and its staging buffers, dropped at launch, stay counted
    until the flush that reads them has run."""
    updater = ResidentSubgroupUpdater(device)
    gen = torch.Generator().manual_seed(3)
    p, grad = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    m, v = torch.zeros(300), torch.zeros(300)
    out = torch.empty(300, dtype=torch.bfloat16)
    want = [t.clone() for t in (p, m, v)]
    adam_step_torch(*want, grad.clone(), HYPER, None)
    launched = updater.launch(p, m, v, grad, out, HYPER)
    finite, _ = launched.result()
    device.close()  # every stream done: the staging is freed
    assert finite and device.sanitizer.error is None
    assert updater.nbytes == 4 * 300 * 4 == device.device_bytes  # states and gradient
    # in the layer's book of the subgroups, which the executor reads while they change
    assert device.device_snapshot() == (device.device_bytes,
                                        {SUBGROUP_BOOK: updater.nbytes})
    updater.to_host(p, m, v)
    for got, expected in zip((p, m, v), want):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(out, want[0].to(torch.bfloat16))
