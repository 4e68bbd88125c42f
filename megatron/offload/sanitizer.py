"""The stream sanitizer of the CPU device layer: every cross-stream race a GPU would hit
raises at once, whether or not the CPU's timing happened to hide it.

On the CPU device the compute stream runs on the caller's thread and each copy stream is a
worker thread, so a missing `stream.wait_event(...)` shows only when a copy thread is late.
The sanitizer checks the order the streams *declare*, not the order they ran in:

* Each stream and each host thread has a vector clock (stream -> the position of its work
  known to be done before whatever it does next). A stream's work takes the next position
  of its own entry; an event carries its stream's clock when recorded; `wait_event` merges
  an event's clock into the stream's; a host wait (`event.wait()`, a synchronisation)
  merges it into the waiting thread's. Work submitted by a thread starts after what that
  thread has waited for, so each submission merges the submitting thread's clock too.
* Each buffer the device layer hands out (device buffers, pinned host buffers) has a
  history, shared by its views: its last write and the reads since, each with its stream,
  position and the instruction that issued it. An access that conflicts with an earlier
  one (a write with anything, a read with a write) on another stream must be ordered after
  it: the accessing clock's entry for that stream must reach the earlier position.
* Host accesses are synchronous: the work a thread submits after one is ordered after it.
  The sanitizer does not look for races between host threads (locks and futures order
  those; they are not the device layer's business).
* Lifetimes. Giving a buffer back (to a pool that hands it out again, or to the allocator)
  is a free: the stream work that wrote the buffer must be done *by the freeing thread's
  own waits* (events it waited for, streams it synchronised), not by what it learned from
  joining other threads, since the owner queued that work and must not rely on another
  component having waited for it; the reads since must have been waited for by some host
  thread (the reader's component). An operation submitted to a stream may touch only the buffers
  it declares (`reads`, `writes`): on CUDA those are what the stream keeps alive until its
  work is done, so an undeclared one could be freed under it (checked on the first run of
  each kind of operation on each stream).

A race raises StreamRaceError naming the buffer, both streams and both instructions (the
executor says which instruction is running: `at`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

Clock = dict[str, int]
OUTSIDE = "outside the program"


class StreamRaceError(RuntimeError):
    """Two accesses to one buffer that no event wait, stream wait or synchronisation orders."""


@dataclass(frozen=True)
class Access:
    stream: str
    position: int
    write: bool
    what: str  # the operation: "H2D copy", "forward", "host read", ...
    where: str  # the instruction that issued it

    def describe(self) -> str:
        kind = "write" if self.write else "read"
        return f"{kind} on {self.stream} ({self.what}; {self.where})"


@dataclass
class _History:
    name: str
    last_write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)  # latest per stream since the write


def host_clock_name() -> str:
    return f"host thread {threading.current_thread().name!r}"


def _key(tensor: torch.Tensor) -> int:
    """Views share their base's storage, hence its history."""
    return tensor.untyped_storage().data_ptr()


class Sanitizer:
    def __init__(self) -> None:
        # re-entrant: a buffer's finalizer (_forget) may run inside a locked section
        # when a garbage collection happens there
        self._lock = threading.RLock()
        self._clocks: dict[str, Clock] = {}
        # per host thread: what it has waited for itself (no joins), for frees
        self._own: dict[str, Clock] = {}
        self._ops_checked: set[tuple[str, str]] = set()  # (stream, what) watched once
        self._histories: dict[int, _History] = {}
        self._where = threading.local()
        self._running = OUTSIDE
        self.checked = 0  # accesses checked (tests assert the sanitizer looked at all)
        self.error: StreamRaceError | None = None  # the first race found

    # --- what is running ------------------------------------------------------------------
    def at(self, where: str) -> None:
        """The instruction the executor runs from now on (on its thread)."""
        self._where.value = where
        self._running = where

    def _current(self) -> str:
        """Work of another thread (an optimizer task) is named by what the executor runs
        meanwhile: the task was started by an earlier instruction."""
        own = getattr(self._where, "value", None)
        if own is not None:
            return own
        return f"{threading.current_thread().name}, while {self._running}"

    # --- buffers --------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, name: str) -> None:
        """A buffer handed out: a fresh history (its memory may have held another's)."""
        key, history = _key(tensor), _History(name)
        with self._lock:
            self._histories[key] = history
        weakref.finalize(tensor, self._forget, key, history)

    def _forget(self, key: int, history: _History) -> None:
        with self._lock:
            if self._histories.get(key) is history:
                del self._histories[key]

    # --- clocks ---------------------------------------------------------------------------
    def _clock(self, name: str) -> Clock:
        return self._clocks.setdefault(name, {})

    @staticmethod
    def _merge(into: Clock, other: Clock) -> None:
        for stream, position in other.items():
            if into.get(stream, -1) < position:
                into[stream] = position

    def submit(self, stream: str, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = (), what: str = "") -> None:
        """Work enqueued on `stream` by the calling thread: check and record its accesses."""
        with self._lock:
            clock = self._clock(stream)
            self._merge(clock, self._clock(host_clock_name()))
            clock[stream] = clock.get(stream, 0) + 1
            self._access(stream, clock, reads, writes, what)

    def host_access(self, reads: Iterable[torch.Tensor] = (),
                    writes: Iterable[torch.Tensor] = (), what: str = "") -> None:
        """The calling thread reads or writes host buffers now."""
        name = host_clock_name()
        with self._lock:
            self._access(name, self._clock(name), reads, writes, what)

    def record(self, stream: str) -> Clock:
        """The clock an event recorded now on `stream` carries."""
        with self._lock:
            clock = self._clock(stream)
            self._merge(clock, self._clock(host_clock_name()))
            return dict(clock)

    def stream_wait(self, stream: str, event_clock: Clock | None) -> None:
        """`stream`'s later work is ordered after the event."""
        if event_clock is None:
            return
        with self._lock:
            self._merge(self._clock(stream), event_clock)

    def host_wait(self, event_clock: Clock | None) -> None:
        """The calling thread has seen the event complete."""
        if event_clock is None:
            return
        name = host_clock_name()
        with self._lock:
            self._merge(self._clock(name), event_clock)
            self._merge(self._own.setdefault(name, {}), event_clock)

    def join_host_threads(self) -> None:
        """A barrier of the host threads (the caller waited for every task of the others):
        each one's clock becomes the union of all of them."""
        with self._lock:
            joined: Clock = {}
            hosts = [clock for name, clock in self._clocks.items() if name.startswith("host ")]
            for clock in hosts:
                self._merge(joined, clock)
            for clock in hosts:
                self._merge(clock, joined)

    def free(self, tensors: Iterable[torch.Tensor], what: str = "") -> None:
        """The calling thread gives these buffers back. The stream work that wrote them
        (the copy their owner queued) must be done by this thread's own waits; the reads
        since, by some host thread's waits (a reader's component waits for its own work,
        and how host threads hand work over is not modelled). Afterwards they start a
        fresh history (as if handed out)."""
        name = host_clock_name()
        with self._lock:
            own, clock = self._own.get(name, {}), {}
            for thread, known in self._clocks.items():
                if thread.startswith("host "):
                    self._merge(clock, known)
            for tensor in tensors:
                history = self._histories.get(_key(tensor))
                if history is None:
                    continue
                self.checked += 1
                free = Access(name, 0, True, what, self._current())
                earlier = [(own, history.last_write)] if history.last_write else []
                for known, before in [*earlier, *((clock, r) for r in history.reads.values())]:
                    if before.stream != name and known.get(before.stream, 0) < before.position:
                        self._race(history, free, before, verb="freed by")
                history.last_write, history.reads = None, {}

    def declared_only(self, op: Callable[[], None], reads: Iterable[torch.Tensor],
                      writes: Iterable[torch.Tensor], stream: str,
                      what: str) -> Callable[[], None]:
        """`op`, checking as it runs that each buffer of the layer it touches is one it
        declared (written ones among `writes`). Watching every torch call costs about a
        millisecond, so each kind of operation (`what`) is checked the first time it runs
        on a stream: its code, hence what it touches, is the same every time."""
        with self._lock:
            if (stream, what) in self._ops_checked:
                return op
            self._ops_checked.add((stream, what))
        declared_writes = {_key(t) for t in writes}
        declared = declared_writes | {_key(t) for t in reads}
        where = self._current()

        def checked() -> None:
            with _DeclaredOnly(self, declared, declared_writes, stream, what, where):
                op()
        return checked

    def _undeclared(self, tensor: torch.Tensor, write: bool, declared: set[int],
                    declared_writes: set[int], stream: str, what: str, where: str) -> None:
        if tensor.untyped_storage().nbytes() == 0:  # no memory to race on
            return
        key = _key(tensor)
        if key in (declared_writes if write else declared):
            return
        with self._lock:
            history = self._histories.get(key)
        if history is None:  # not handed out by the device layer
            return
        error = StreamRaceError(
            f"undeclared access on {history.name}: {what} on {stream} ({where}) "
            f"{'writes' if write else 'reads'} it without declaring it in its "
            f"{'writes' if write else 'reads or writes'}: on CUDA the stream would not "
            "keep it alive until the work is done, nor would the sanitizer order it")
        if self.error is None:
            self.error = error
        raise error

    # --- the check ------------------------------------------------------------------------
    def _access(self, stream: str, clock: Clock, reads: Iterable[torch.Tensor],
                writes: Iterable[torch.Tensor], what: str) -> None:
        where = self._current()
        position = clock.get(stream, 0)
        for tensors, write in ((reads, False), (writes, True)):
            for tensor in tensors:
                history = self._histories.get(_key(tensor))
                if history is None:  # not handed out by the device layer: not tracked
                    continue
                self.checked += 1
                access = Access(stream, position, write, what, where)
                earlier = [history.last_write] if history.last_write is not None else []
                if write:
                    earlier += history.reads.values()
                for before in earlier:
                    if before.stream != stream and clock.get(before.stream, 0) < before.position:
                        self._race(history, access, before)
                if write:
                    history.last_write, history.reads = access, {}
                else:
                    history.reads[stream] = access

    def _race(self, history: _History, access: Access, before: Access,
              verb: str = "") -> None:
        if verb:  # a free: the owner gave the buffer back too early
            error = StreamRaceError(
                f"stream race on {history.name}: {verb} {access.stream} ({access.what}; "
                f"{access.where}) before it waited for the {before.describe()}: the "
                "memory may be handed out again while that stream still uses it")
        else:
            error = StreamRaceError(
                f"stream race on {history.name}: {access.describe()} is not ordered after "
                f"the {before.describe()}: no event wait, stream wait or synchronisation "
                "orders them")
        if self.error is None:
            self.error = error
        raise error


class _DeclaredOnly(TorchFunctionMode):
    """Checks the tensors every torch call made inside gets (this thread only: the mode
    stack is per thread). A call writes its first argument when it is in place (`copy_`,
    `fill_`, `x[i] = ...`) and its `out=`; it reads the others. A function mode, not a
    dispatch mode: it sees the calls the operation makes, and costs no import of torch's
    compiler."""

    def __init__(self, sanitizer: Sanitizer, declared: set[int], declared_writes: set[int],
                 stream: str, what: str, where: str) -> None:
        super().__init__()
        self._check = lambda tensor, write: sanitizer._undeclared(
            tensor, write, declared, declared_writes, stream, what, where)

    def __torch_function__(self, func, types, operands=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        for index, arg in enumerate(operands):
            for tensor in tree_flatten(arg)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._check(tensor, in_place and index == 0)
        for key, arg in kwargs.items():
            for tensor in tree_flatten(arg)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._check(tensor, key == "out")
        return func(*operands, **kwargs)
