"""The device layer: device memory, a compute stream, H2D and D2H copy streams, events.

Everything above this module (prefetch, gradient offload, the executor) talks only to
`DeviceLayer`, so the same code runs on CUDA and, in tests and CI, on the CPU:

* CUDA: CUDA streams, timing events and pinned host memory.
* CPU: each process plays one GPU. "Device memory" is private tensors. The compute
  stream is synchronous (work runs on the caller's thread); each copy stream is a
  background thread that runs its operations in submission order. An event completes
  when the operations submitted before it on its stream have finished; waiting on an
  event blocks only the waiter. torch copies release the GIL, so overlap is real.

Events carry completion times (`time_s()`, seconds since the device layer was created)
so that the executor can measure compute, copy and idle times per rank.

Checks (CPU layer only; see docs/device-sanitizer.md): `sanitize=True` (--device-sanitizer,
or MEGATRON_DEVICE_SANITIZER=1) checks every access to the buffers the layer hands out
against the order the streams declare (megatron/offload/sanitizer.py); `chaos_seed`
(--device-chaos SEED, or MEGATRON_DEVICE_CHAOS=SEED) delays each copy stream's operations
by seeded random amounts, so that a missing wait shows as wrong numbers. On CUDA,
`sanitize=True` (the flag, not the environment) turns on torch's CUDA sanitizer instead.

Lifetimes: a tensor a stream's work touches must stay allocated until that work is done.
On the CPU layer the submitted closure holds it until it has run. On CUDA `submit` runs the
launch at once, so the stream keeps every tensor the operation declares (`reads`, `writes`)
until an event recorded after it has completed (`KeepAlive`; released when a later
submission or a synchronisation finds the event done). That covers device tensors of the
caching allocator (what `Tensor.record_stream` would do) and pinned host buffers alike.
The CPU sanitizer checks that an operation touches only the buffers it declares, and that
whoever gives a buffer back to a pool has itself waited for the streams' work on it.

Device memory of the CPU layer: unbounded by default (it is host memory). The environment
variable MEGATRON_CPU_DEVICE_MEMORY (a byte count: 512MiB, 2GiB) gives it a capacity, so
that a CPU run meets the limits a GPU run does: `mem_get_info` reports the capacity less
what the layer holds, as torch.cuda.mem_get_info does, the fit check and auto's subgroups
size against it, and holding more than the capacity raises torch.OutOfMemoryError, as
CUDA's allocator does: a buffer the layer hands out beyond it, or the executor's book
(its buffers, activations and checkpoints at an instruction boundary) above it.

Host synchronisations: on a GPU, reading a device value on the host or waiting for the
device stalls the thread that feeds the GPU. Such reads and waits on the main thread go
through `read_scalar` and `wait_for`, which count them (`host_syncs`) on both layers, so a
CPU test can bound what a GPU run would stall on.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

import megatron.offload.host_pinning as host_pinning
from megatron.common.units import format_bytes
from megatron.config.device_choice import CPU_DEVICE_MEMORY_ENV, cpu_device_capacity
from megatron.offload.sanitizer import Clock, Sanitizer

SANITIZER_ENV = "MEGATRON_DEVICE_SANITIZER"  # "1": as --device-sanitizer
CHAOS_ENV = "MEGATRON_DEVICE_CHAOS"  # a seed: as --device-chaos SEED
CHAOS_MAX_DELAY_S = 0.002  # the longest delay chaos puts before a copy stream's operation
def out_of_memory(what: str, capacity: int) -> torch.OutOfMemoryError:
    """The CPU layer's counterpart of CUDA's allocator error."""
    return torch.OutOfMemoryError(f"CPU device layer out of memory: {what}; its capacity is "
                                  f"{format_bytes(capacity)} ({CPU_DEVICE_MEMORY_ENV})")


class Event(Protocol):
    """What every event offers; the CPU optimizer only ever calls `wait()`."""

    def wait(self) -> None: ...

    def query(self) -> bool: ...

    def time_s(self) -> float: ...


class CopyError(RuntimeError):
    """An operation on a background copy stream failed."""


class CpuEvent:
    """Completed by the thread that runs its stream; records the completion time."""

    def __init__(self, origin: float, sanitizer: Sanitizer | None = None,
                 clock: Clock | None = None) -> None:
        self._done = threading.Event()
        self._origin = origin
        self._time: float | None = None
        self._error: BaseException | None = None
        self._sanitizer = sanitizer
        self._clock = clock  # what the stream had issued when the event was recorded

    def _complete(self, error: BaseException | None = None) -> None:
        self._time = time.perf_counter() - self._origin
        self._error = error
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block the calling host thread until the event completes."""
        self._block(timeout_s)
        if self._sanitizer is not None:
            self._sanitizer.host_wait(self._clock)

    def _block(self, timeout_s: float | None = None) -> None:
        """Wait without ordering the caller: a stream's worker thread waiting for another."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"event not completed after {timeout_s} s")
        if self._error is not None:
            raise CopyError(f"a copy before this event failed: {self._error}") from self._error

    def query(self) -> bool:
        return self._done.is_set()

    def time_s(self) -> float:
        """Completion time in seconds since the device layer started (waits for it)."""
        self.wait()
        assert self._time is not None
        return self._time


class CpuStream:
    """A stream on the CPU device: synchronous (compute) or backed by one worker thread."""

    def __init__(self, name: str, origin: float, synchronous: bool,
                 sanitizer: Sanitizer | None = None, chaos_seed: int | None = None) -> None:
        self.name = name
        self._origin = origin
        self._synchronous = synchronous
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._sanitizer = sanitizer
        self._chaos = None if chaos_seed is None else random.Random(
            f"{chaos_seed}/{os.environ.get('RANK', '0')}/{name}")

    def submit(self, op: Callable[[], None], reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = (), what: str = "kernel") -> None:
        """Run `op` after everything submitted before it on this stream. `reads` and
        `writes`: the buffers it touches, for the sanitizer."""
        if self._sanitizer is not None:
            reads, writes = tuple(reads), tuple(writes)
            self._sanitizer.submit(self.name, reads, writes, what)
            op = self._sanitizer.declared_only(op, reads, writes, self.name, what)
        self._enqueue(op)

    def _enqueue(self, op: Callable[[], None]) -> None:
        if self._synchronous:
            op()
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"copy-stream-{self.name}", daemon=True
                )
                self._thread.start()
        self._queue.put(op)

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            if self._chaos is not None:
                time.sleep(self._chaos.uniform(0.0, CHAOS_MAX_DELAY_S))
            try:
                op()
            except BaseException as exc:  # reported by every later event of this stream
                if self._error is None:
                    self._error = exc

    def record_event(self) -> CpuEvent:
        clock = None if self._sanitizer is None else self._sanitizer.record(self.name)
        event = CpuEvent(self._origin, self._sanitizer, clock)
        self._enqueue(lambda: event._complete(self._error))
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts only after `event` completes."""
        if isinstance(event, CpuEvent):
            if self._sanitizer is not None:
                self._sanitizer.stream_wait(self.name, event._clock)
            self._enqueue(event._block)
        else:
            self._enqueue(event.wait)

    def synchronize(self) -> None:
        self.record_event().wait()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


class CudaEvent:
    """A CUDA timing event; `time_s` is measured against the layer's origin event."""

    def __init__(self, origin: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        self._origin = origin
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record(stream)

    def wait(self) -> None:
        self._event.synchronize()

    def query(self) -> bool:
        return self._event.query()

    def time_s(self) -> float:
        self._event.synchronize()
        return self._origin.elapsed_time(self._event) / 1000.0

    @property
    def cuda_event(self) -> torch.cuda.Event:
        return self._event


class KeepAlive:
    """References held until the work that uses them is done: each batch is released once
    the event recorded after that work reports completion (checked when more is held, or
    all at once after a synchronisation), so memory is neither freed under a stream nor
    held long after it."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Event, tuple[torch.Tensor, ...]]] = deque()
        self._lock = threading.Lock()  # several optimizer threads submit to one stream

    def hold(self, done: Event, refs: tuple[torch.Tensor, ...]) -> None:
        with self._lock:
            self._release_done()
            if refs:
                self._pending.append((done, refs))

    def _release_done(self) -> None:
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()

    def release_done(self) -> None:
        with self._lock:
            self._release_done()

    def release_all(self) -> None:
        """After the stream's work is known to be done (a synchronisation)."""
        with self._lock:
            self._pending.clear()

    @property
    def held(self) -> int:
        """Tensors held now."""
        with self._lock:
            return sum(len(refs) for _, refs in self._pending)


class CudaStream:
    def __init__(self, name: str, origin: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        self.name = name
        self._origin = origin
        self.stream = stream
        self.keep_alive = KeepAlive()

    def submit(self, op: Callable[[], None], reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = (), what: str = "kernel") -> None:
        """Launch `op` on this stream now; the tensors it declares stay referenced until
        the stream has run it (the launch returns before the GPU has)."""
        with torch.cuda.stream(self.stream):
            op()
        done = torch.cuda.Event()
        done.record(self.stream)
        self.keep_alive.hold(done, (*reads, *writes))

    def record_event(self) -> CudaEvent:
        return CudaEvent(self._origin, self.stream)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.stream.wait_event(event.cuda_event)
        else:  # a host-side event (e.g. a CPU optimizer finishing): block the submitter
            event.wait()

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.keep_alive.release_all()

    def close(self) -> None:
        self.synchronize()


Stream = CpuStream | CudaStream


MEMORY_CATEGORIES = ("parameter_slots", "gradient_buffers", "activation_checkpoints",
                     "activations", "optimizer_subgroups")


class MemoryBook:
    """What the runtime holds in device memory, by category, and the peak of the total.

    The executor reports its holdings at every instruction boundary and inside each
    backward (its working activations), on CUDA and on the CPU alike, so the figures mean
    the same on both layers. Its buffers (slots, gradient buffers, the upcast scratch,
    the optimizer subgroups) are all handed out by the layer (`DeviceLayer.device_bytes`,
    checked against the book under the sanitizer); activations, checkpoints and messages
    are the tensors the executor keeps; the working activations are what autograd saves,
    which depends on the kernels torch picks for the device. CUDA's caching-allocator peak
    (`allocator_peak_bytes`) is a separate figure.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        """`capacity_bytes`: the CPU layer's capacity, checked at every observation (None:
        unchecked; on CUDA the allocator itself fails first)."""
        self.capacity_bytes = capacity_bytes
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)

    def observe(self, held: dict[str, int]) -> None:
        total = sum(held.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_breakdown = {name: held.get(name, 0) for name in MEMORY_CATEGORIES}
            if self.capacity_bytes is not None and total > self.capacity_bytes:
                parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                  for k, v in held.items() if v)
                raise out_of_memory(f"the runtime holds {format_bytes(total)} ({parts})",
                                    self.capacity_bytes)

    def reset_peak(self) -> None:
        self.__init__(self.capacity_bytes)


class AccessChecks:
    """What the CPU sanitizer is told beyond the streams' own `submit`s: the buffers handed
    out, work launched inline, the host's reads, writes and frees, and where the program
    is. Each call costs one `is not None` when the sanitizer is off (always on CUDA)."""

    def __init__(self, sanitizer: Sanitizer | None) -> None:
        self.sanitizer = sanitizer
        self._buffers = 0

    def register(self, tensor: torch.Tensor, name: str | None, kind: str) -> torch.Tensor:
        """A buffer the layer hands out, under `name` (or `kind`) in the sanitizer's words."""
        if self.sanitizer is not None:
            self._buffers += 1
            self.sanitizer.register(tensor, f"{name or kind} #{self._buffers} "
                                            f"({tensor.numel()} x {tensor.dtype})")
        return tensor

    def kernel(self, stream: Stream, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = (), what: str = "kernel") -> None:
        """Declare work launched now by the calling thread on `stream` outside `submit`
        (the compute stream's forward and backward run inline): checked and recorded."""
        if self.sanitizer is not None:
            self.sanitizer.submit(stream.name, reads, writes, what)

    def host_read(self, *tensors: torch.Tensor, what: str = "host read") -> None:
        """The calling thread is about to read these (pinned) host buffers."""
        if self.sanitizer is not None:
            self.sanitizer.host_access(reads=tensors, what=what)

    def host_write(self, *tensors: torch.Tensor, what: str = "host write") -> None:
        """The calling thread is about to write these (pinned) host buffers."""
        if self.sanitizer is not None:
            self.sanitizer.host_access(writes=tensors, what=what)

    def host_free(self, *tensors: torch.Tensor, what: str = "host free") -> None:
        """The calling thread gives these buffers back (to a pool): the sanitizer checks
        that it has itself waited for every stream's work on them."""
        if self.sanitizer is not None:
            self.sanitizer.free(tensors, what=what)

    def host_threads_joined(self) -> None:
        """The calling thread has waited for every host thread's tasks (the optimizer's
        wait_all): what any host thread has waited for is known to all of them."""
        if self.sanitizer is not None:
            self.sanitizer.join_host_threads()

    def at_instruction(self, where: str) -> None:
        """Name the instruction that issues the calling thread's work from now on."""
        if self.sanitizer is not None:
            self.sanitizer.at(where)


class LiveBytes:
    """The bytes of the device buffers handed out that are still referenced: each counts
    until the last reference to it is gone. A buffer may name the `book` it is accounted
    under: its bytes then also count there, changed under the same lock as the total, so
    that a snapshot of both is consistent while other threads allocate and free."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        """`capacity_bytes`: more than this held raises torch.OutOfMemoryError (None: no
        limit)."""
        self.capacity_bytes = capacity_bytes
        self._nbytes = 0
        self._by_book: dict[str, int] = {}
        self._lock = threading.RLock()  # finalizers may run inside it
        self._buffers: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def count(self, tensor: torch.Tensor, book: str | None = None) -> torch.Tensor:
        with self._lock:
            if (self.capacity_bytes is not None
                    and self._nbytes + tensor.nbytes > self.capacity_bytes):
                raise out_of_memory(f"tried to allocate {format_bytes(tensor.nbytes)} with "
                                    f"{format_bytes(self._nbytes)} held", self.capacity_bytes)
            self._nbytes += tensor.nbytes
            if book is not None:
                self._by_book[book] = self._by_book.get(book, 0) + tensor.nbytes
            self._buffers.add(tensor)
        weakref.finalize(tensor, self._freed, tensor.nbytes, book)
        return tensor

    def _freed(self, nbytes: int, book: str | None) -> None:
        with self._lock:
            self._nbytes -= nbytes
            if book is not None:
                self._by_book[book] -= nbytes

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def snapshot(self) -> tuple[int, dict[str, int]]:
        """The total and each book's bytes, at one instant."""
        with self._lock:
            return self._nbytes, dict(self._by_book)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers still referenced (for measurements of the memory behind them)."""
        with self._lock:
            return list(self._buffers)


class DeviceLayer:
    """Device memory, three streams (compute, h2d, d2h) and events, on CUDA or the CPU."""

    def __init__(self, kind: str = "cpu", index: int = 0, sanitize: bool = False,
                 chaos_seed: int | None = None) -> None:
        """`sanitize`, `chaos_seed`: see the module docstring; the environment variables
        SANITIZER_ENV and CHAOS_ENV turn them on as well (tests set them)."""
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device kind={kind!r}: expected 'cpu' or 'cuda'")
        self.kind = kind
        # The environment (set by the tests) acts on the CPU layer only: on a GPU machine
        # the suite does not run every rank under torch's far slower CUDA sanitizer.
        checked = sanitize or os.environ.get(SANITIZER_ENV, "") == "1"
        if chaos_seed is None and os.environ.get(CHAOS_ENV):
            chaos_seed = int(os.environ[CHAOS_ENV])
        # None when off: every check below is one `is not None`
        self.sanitizer: Sanitizer | None = Sanitizer() if checked and kind == "cpu" else None
        self.chaos_seed = chaos_seed if kind == "cpu" else None
        self.checks = AccessChecks(self.sanitizer)
        # the CPU layer's device memory, when bounded (CUDA's own allocator bounds its)
        self.capacity_bytes = cpu_device_capacity() if kind == "cpu" else None
        self._live = LiveBytes(self.capacity_bytes)  # device buffers handed out (device_bytes)
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device kind='cuda' requested but CUDA is not available")
            self.torch_device = torch.device("cuda", index)
            torch.cuda.set_device(self.torch_device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream())
            self.compute_stream: Stream = CudaStream("compute", origin, torch.cuda.current_stream())
            self.h2d_stream: Stream = CudaStream("h2d", origin, torch.cuda.Stream())
            self.d2h_stream: Stream = CudaStream("d2h", origin, torch.cuda.Stream())
            if sanitize:  # torch's own: checks kernels' accesses against CUDA's stream order
                import torch.cuda._sanitizer as csan

                csan.enable_cuda_sanitizer()
        else:
            self.torch_device = torch.device("cpu")
            origin_s = time.perf_counter()
            self.compute_stream = self._cpu_stream("compute", origin_s, synchronous=True)
            self.h2d_stream = self._cpu_stream("h2d", origin_s, synchronous=False)
            self.d2h_stream = self._cpu_stream("d2h", origin_s, synchronous=False)
        self.host_syncs = 0  # reads and waits that block the host on the device
        self.memory = MemoryBook(self.capacity_bytes)
        self._side_streams: list[Stream] = []

    def _cpu_stream(self, name: str, origin_s: float, synchronous: bool) -> CpuStream:
        return CpuStream(name, origin_s, synchronous, self.sanitizer, self.chaos_seed)

    def bind_current_thread(self) -> None:
        """Make this layer's device the calling thread's current one (CUDA keeps it per
        thread; every thread that touches CUDA, event waits included, needs it)."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.torch_device)

    # memory -------------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, name: str | None = None,
              stream: Stream | None = None, book: str | None = None) -> torch.Tensor:
        """A flat buffer in device memory (`name`: what the sanitizer calls it). `stream`:
        the one that uses it first (default: the compute stream). On CUDA the caching
        allocator hands out memory in the order of the stream it is allocated on, so a
        buffer first used on a side stream is allocated there. `book`: the part of
        `device_snapshot` it counts in (for buffers other threads allocate and free)."""
        with self.on(stream or self.compute_stream):
            tensor = torch.empty(numel, dtype=dtype, device=self.torch_device)
        return self._device_buffer(tensor, name, book)

    def zeros(self, numel: int, dtype: torch.dtype, name: str | None = None,
              stream: Stream | None = None) -> torch.Tensor:
        """As `empty`, zero-filled: a kernel on `stream` (default: the compute stream),
        which later work on other streams must wait for like any write."""
        stream = stream or self.compute_stream
        with self.on(stream):
            tensor = torch.zeros(numel, dtype=dtype, device=self.torch_device)
        tensor = self._device_buffer(tensor, name)
        self.checks.kernel(stream, writes=(tensor,), what="zero-filling a new buffer")
        return tensor

    def _device_buffer(self, tensor: torch.Tensor, name: str | None,
                       book: str | None = None) -> torch.Tensor:
        """Counted in `device_bytes` (and `book`) until the last reference to it is gone."""
        return self.checks.register(self._live.count(tensor, book), name, "device buffer")

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffers this layer handed out that are still referenced
        (by their owner or by a stream's keep-alive), on CUDA and the CPU alike."""
        return self._live.nbytes

    def device_snapshot(self) -> tuple[int, dict[str, int]]:
        """`device_bytes` and the bytes of each book (`empty`'s `book`), at one instant:
        buffers that threads of their own allocate and free cannot change one without the
        other between the two readings."""
        return self._live.snapshot()

    def live_buffers(self) -> list[torch.Tensor]:
        """The device buffers counted in `device_bytes` (on the CPU layer, host memory:
        what bench/host_memory.py measures as the layer's own)."""
        return self._live.buffers()

    def mem_get_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes, as torch.cuda.mem_get_info: on the CPU layer the
        capacity less what this layer holds; None when the CPU layer is unbounded."""
        if self.kind == "cuda":
            return torch.cuda.mem_get_info(self.torch_device)
        if self.capacity_bytes is None:
            return None
        return max(0, self.capacity_bytes - self.device_bytes), self.capacity_bytes

    def pin_host(self, numel: int, dtype: torch.dtype, name: str | None = None) -> torch.Tensor:
        """Page-locked host memory on CUDA, exactly this size (host_pinning.pinned_empty);
        raises if pinning fails. CPU: plain memory."""
        if self.kind == "cuda":
            return host_pinning.pinned_empty(numel, dtype)
        return self.checks.register(torch.empty(numel, dtype=dtype), name, "pinned host buffer")

    def allocator_peak_bytes(self) -> int | None:
        """CUDA's caching-allocator peak since the last reset (None on the CPU layer)."""
        if self.kind != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.torch_device)

    def reset_peak_memory(self) -> None:
        self.memory.reset_peak()
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)

    @property
    def pins_memory(self) -> bool:
        return self.kind == "cuda"

    # streams and events -------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """Copy `src` into `dst` on `stream`, after earlier work there; returns its event."""
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} elements into a {dst.numel()}-element buffer")
        stream.submit(lambda: dst.copy_(src.view(dst.shape), non_blocking=True),
                      reads=(src,), writes=(dst,), what=f"copy on {stream.name}")
        return stream.record_event()

    def side_stream(self, name: str) -> Stream:
        """Another stream, e.g. for optimizer subgroups' copies and updates so they do not
        queue behind parameter prefetch (CPU: one more worker thread); closed with the
        layer."""
        if self.kind == "cuda":
            origin = self.compute_stream._origin  # type: ignore[union-attr]
            stream: Stream = CudaStream(name, origin, torch.cuda.Stream(self.torch_device))
        else:
            stream = self._cpu_stream(name, self.compute_stream._origin, synchronous=False)  # type: ignore[union-attr]
        self._side_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        """Make `stream` current for the kernels launched inside (CUDA); CPU: no-op."""
        if isinstance(stream, CudaStream):
            with torch.cuda.stream(stream.stream):
                yield
        else:
            yield

    def synchronize(self) -> None:
        self.host_syncs += 1
        for stream in (self.compute_stream, self.h2d_stream, self.d2h_stream):
            stream.synchronize()

    # host synchronisation ---------------------------------------------------------------
    def read_scalar(self, tensor: torch.Tensor) -> float:
        """A one-element device tensor's value on the host: one host synchronisation."""
        self.host_syncs += 1
        return float(tensor)

    def wait_for(self, stream: Stream) -> None:
        """Block the calling (main) thread until `stream`'s work is done: one host sync."""
        self.host_syncs += 1
        stream.synchronize()

    def close(self) -> None:
        """Finish queued work and stop the copy threads."""
        for stream in (self.h2d_stream, self.d2h_stream, self.compute_stream,
                       *self._side_streams):
            stream.close()

    def __enter__(self) -> DeviceLayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_device(kind: str | None = None, index: int | None = None, sanitize: bool = False,
               chaos_seed: int | None = None) -> DeviceLayer:
    """The device layer for this process: CUDA when available (or asked), else the CPU.

    `index` defaults to LOCAL_RANK modulo the visible GPUs, as torchrun sets it.
    """
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if index is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % max(torch.cuda.device_count(), 1) if kind == "cuda" else 0
    return DeviceLayer(kind, index, sanitize, chaos_seed)
