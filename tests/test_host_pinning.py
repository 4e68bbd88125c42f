"""Shared-memory segments are page-locked on CUDA; a failed registration warns once,
naming the locked-memory limit, and leaves the segment usable; what a process page-locks
beyond its limit is said with the fix."""

import uuid
import warnings

import pytest
import torch

import megatron.offload.host_pinning as host_pinning
from megatron.config.errors import ConfigError
from megatron.offload.param_store import ParameterStore


@pytest.fixture
def store():
    with ParameterStore(job_id=f"test-pin-{uuid.uuid4().hex[:8]}", rank=0,
                        procs_per_node=1) as s:
        yield s


@pytest.mark.cuda
def test_segments_are_page_locked_on_cuda(store):
    segment = store.create((0, 0), 1 << 20, torch.bfloat16)
    assert segment.pinned and segment.params.is_pinned()
    store.release((0, 0))
    assert not segment.pinned


def test_without_cuda_nothing_is_registered(store, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    segment = store.create((0, 0), 1024, torch.float32)
    assert not segment.pinned


def test_a_refused_registration_warns_once_with_the_limit(store, monkeypatch):
    class Refusing:
        calls = 0

        def cudaHostRegister(self, address, nbytes, flags):
            Refusing.calls += 1
            return 2  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, address):
            raise AssertionError("nothing was registered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_pinning, "_cudart", Refusing)
    monkeypatch.setattr(host_pinning, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = store.create((0, 0), 1024, torch.float32)
        second = store.create((0, 1), 1024, torch.float32)
    assert Refusing.calls == 2 and not first.pinned and not second.pinned
    messages = [str(w.message) for w in caught if "cudaHostRegister" in str(w.message)]
    assert len(messages) == 1 and "ulimit -l" in messages[0]
    first.params.fill_(1.0)  # still an ordinary, usable mapping
    store.release((0, 0))
    store.release((0, 1))


class Recording:
    """cudaHostRegister/-Unregister as calls recorded (registration refused when asked)."""

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes))
        return 2 if self.refuse else 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))


def test_pinned_buffers_lock_exactly_their_size_until_the_last_view_is_gone(monkeypatch):
    import gc

    cudart = Recording()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_pinning, "_cudart", lambda: cudart)
    buffer = host_pinning.pinned_empty(3_000_001, torch.bfloat16)
    # torch's pinned allocator would have taken 8 MiB (the next power of two)
    assert cudart.calls == [("register", buffer.data_ptr(), 6_000_002)]
    assert buffer.untyped_storage().nbytes() == 6_000_002
    buffer.fill_(1.0)
    view = buffer[100:]
    del buffer
    gc.collect()
    assert len(cudart.calls) == 1  # a view still uses the memory
    assert view.float().sum().item() == 3_000_001 - 100
    address = cudart.calls[0][1]
    del view
    gc.collect()
    assert cudart.calls[-1] == ("unregister", address)


def test_a_refused_pinned_buffer_raises_for_the_pool_to_fall_back(monkeypatch):
    cudart = Recording(refuse=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_pinning, "_cudart", lambda: cudart)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4000 bytes failed"):
        host_pinning.pinned_empty(1000, torch.float32)
    assert [c[0] for c in cudart.calls] == ["register"]  # nothing left to unregister


@pytest.mark.cuda
def test_pinned_buffers_are_page_locked_on_cuda():
    buffer = host_pinning.pinned_empty(3_000_001, torch.bfloat16)
    assert buffer.is_pinned() and buffer.untyped_storage().nbytes() == 6_000_002
    copied = buffer.fill_(1.0).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert copied.float().sum().item() == 3_000_001


def test_what_a_process_page_locks_beyond_its_limit_is_said_with_the_fix(monkeypatch):
    """The limit is ulimit -l on CUDA; the CPU device layer, which pins nothing, has none
    unless a test stands one in (MEGATRON_CPU_DEVICE_MEMLOCK)."""
    monkeypatch.delenv(host_pinning.CPU_DEVICE_MEMLOCK_ENV, raising=False)
    assert host_pinning.memlock_limit("cpu").nbytes is None
    assert host_pinning.memlock_limit("cuda").source == "ulimit -l"
    monkeypatch.setenv(host_pinning.CPU_DEVICE_MEMLOCK_ENV, "8MiB")
    limit = host_pinning.memlock_limit("cpu")
    assert limit == host_pinning.MemlockLimit(8 << 20, host_pinning.CPU_DEVICE_MEMLOCK_ENV)
    assert host_pinning.memlock_shortfall(8 << 20, limit) is None  # it fits
    short = host_pinning.memlock_shortfall(3 << 30, limit)
    assert short.startup_line() == (
        "pinned memory: a process of this run page-locks 3.00 GiB (the shared-memory "
        "segments it maps and its gradient buffers), MEGATRON_CPU_DEVICE_MEMLOCK allows "
        "8.00 MiB: at least 2.99 GiB stays pageable for the whole run, and copies between it "
        "and the GPU are staged by the driver and block the host instead of overlapping "
        "compute; raise the limit: `ulimit -l unlimited` before the launch, or `docker run "
        "--ulimit memlock=-1`")
    monkeypatch.setenv(host_pinning.CPU_DEVICE_MEMLOCK_ENV, "lots")
    with pytest.raises(ConfigError, match="MEGATRON_CPU_DEVICE_MEMLOCK 'lots': expected a "
                                          "byte count"):
        host_pinning.memlock_limit("cpu")
