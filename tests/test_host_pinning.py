"""Shared-memory segments are page-locked on CUDA; a failed registration warns once,
naming the locked-memory limit, and leaves the segment usable."""

import uuid
import warnings

import pytest
import torch

import megatron.offload.host_pinning as host_pinning
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
