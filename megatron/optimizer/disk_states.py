"""Optimizer states (master, m, v) kept in a file on an NVMe drive, with a bounded window
of them in host memory (--optimizer-state-location nvme).

Every group has two versions of its state in the file: the committed one and the staged
one. A step reads the committed version into a window buffer, updates it in host memory
and writes the result to the staged version; the iteration's verdict commits it (the two
versions swap roles: no data moves) or drops it. With exact rollbacks a rollback
therefore re-reads the committed bytes, and a clipping correction re-runs the step from
them, with no host snapshot; without, both run the arithmetic inverse on the staged
bytes, as host memory does (the tier never changes the numbers). The file holds twice
the states.

The pipeline's program says when: READ_OPTIMIZER_STATES asks for a group's committed
state (a reader thread takes a window buffer, waiting for one if all are lent, and starts
the read), the step waits for the read, WRITE_OPTIMIZER_STATES asks for the staged write
(a writer thread waits for the step, writes, then gives the buffer back). Both threads
take requests in program order; a read never waits for a write asked for after it, so
no request waits on the main thread. Rollbacks, corrections and loads go through one
scratch buffer of their own, a chunk of a group at a time (STATE_SCRATCH_CHUNK elements of
p, m and v: the window holds stages, the scratch never more than a chunk), so they never
wait for the window the next iteration's reads hold.

Layout: per group and version, [p | m | v], each part padded to the I/O alignment
(state_layout.py). Files are named after the host, the job, the rank and the pid
(state_file_names.py), removed on close, by the reaper when the process dies, and swept
at the next start when their process is gone. Which version is committed, and the order
of writes, corrections and verdicts, is the version book's (state_versions.py).
"""

from __future__ import annotations

import mmap
import os
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from megatron.common.units import format_bytes
from megatron.optimizer.state_file_names import state_file_name, sweep_stale
from megatron.optimizer.state_io import ALIGNMENT, StateFile, aligned_empty, round_up, shared_engine
from megatron.optimizer.state_layout import (
    buffer_sizes,
    file_bytes,
    layout_regions,
    region_views,
    scratch_elements,
    window_bytes,
)
from megatron.optimizer.state_versions import VersionBook
from megatron.schedules.memory_model import STATE_SCRATCH_CHUNK

# Callers import the file's names and sizes from here with the states themselves.
__all__ = ["DiskStateError", "DiskStates", "FileTracker", "file_bytes", "state_file_name",
           "sweep_stale", "window_bytes"]


def _free_space(directory: str | os.PathLike) -> str:
    try:
        return format_bytes(shutil.disk_usage(directory).free)
    except OSError:
        return "?"


class FileTracker(Protocol):
    """Who removes a file if this process dies without removing it (the pipeline passes
    the reaper that also removes its shared-memory segments)."""

    def track(self, path: str) -> None: ...

    def untrack(self, path: str) -> None: ...


class DiskStateError(RuntimeError):
    """A read or write of the state file failed (one line naming the path)."""


class _Residency:
    """One read of a group, its step and its write: the window buffer it holds from the
    read to the end of the write. Its own events: the next iteration's read of the group
    may be asked for while this write is still going on."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.resident = threading.Event()  # the read is done (or failed: error)
        self.stepped = threading.Event()  # the step is over
        self.updated = False  # the step changed the state
        self.write_asked = False
        self.error: BaseException | None = None


ChunkRun = Callable[[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], None]


class DiskStates:
    """The state file of one process and its host window (see the module docstring).
    `versions`: the book of each group's committed and staged versions (its verdicts,
    reserve and release are asked of it directly)."""

    def __init__(self, directory: str | os.PathLike, numels: Sequence[int],
                 master_dtype: torch.dtype, state_dtype: torch.dtype, window: int,
                 job: str, rank: int, tracker: FileTracker,
                 classes: Sequence[int] | None = None, log: Callable[[str], None] = print,
                 io_threads: int = 4, chunk: int = STATE_SCRATCH_CHUNK) -> None:
        """`window` buffers per class of groups (`classes[g]`, default one class): a
        pipeline stage has two groups, its decayed elements and the others (classes 0 and
        1), so a window of W stages holds W of each, not 2W of the largest. `chunk`: the
        elements the scratch buffer holds (a multiple of the I/O alignment)."""
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        if chunk < 1 or chunk % ALIGNMENT:
            raise ValueError(f"chunk={chunk} must be a positive multiple of {ALIGNMENT}")
        self.chunk = chunk
        self.master_dtype, self.state_dtype = master_dtype, state_dtype
        self.regions = layout_regions(numels, master_dtype, state_dtype)
        self.path = str(Path(directory) / state_file_name(job, rank))
        nbytes = file_bytes(numels, master_dtype, state_dtype)
        try:
            self._file = StateFile(self.path, nbytes, shared_engine(io_threads))
        except OSError as error:  # e.g. ENOSPC reserving it: one line, nothing left behind
            raise DiskStateError(f"optimizer state file {self.path}: cannot be created "
                                 f"({error.strerror or error}; it takes {format_bytes(nbytes)}, "
                                 f"{_free_space(directory)} free there)") from None
        self._tracker = tracker
        tracker.track(self.path)  # removed if this process dies without close()
        try:
            self._setup(numels, classes, window, directory, log)
        except BaseException:  # e.g. no memory for the window: nothing left behind
            self._file.close(unlink=True)
            tracker.untrack(self.path)
            raise

    def _setup(self, numels: Sequence[int], classes: Sequence[int] | None, window: int,
               directory: str | os.PathLike, log: Callable[[str], None]) -> None:
        if not self._file.direct:
            log(f"optimizer states: {directory} does not support O_DIRECT; using buffered "
                "I/O (the page cache then holds copies of the states)")
        self.classes = list(classes) if classes is not None else [0] * len(numels)
        if len(self.classes) != len(numels):
            raise ValueError(f"classes has {len(self.classes)} entries for {len(numels)} groups")
        sizes = buffer_sizes(self.regions, self.classes)
        self.window = window
        self._free: dict[int, queue.Queue[torch.Tensor]] = {}
        for kind, size in sizes.items():
            self._free[kind] = queue.Queue()
            for _ in range(window):
                self._free[kind].put(aligned_empty(size))
        scratch = scratch_elements(numels, self.chunk)
        self._scratch_region = layout_regions([scratch], self.master_dtype,
                                              self.state_dtype)[0]
        self._scratch = aligned_empty(self._scratch_region.version_bytes)
        self._scratch_lock = threading.Lock()
        self.host_bytes = window_bytes(numels, self.master_dtype, self.state_dtype, window,
                                       self.classes, self.chunk)
        self.versions = VersionBook(len(numels))
        self._cond = self.versions.cond  # also guards the hand-over of window buffers
        self._current: list[_Residency | None] = [None] * len(numels)  # latest read asked
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self._mapped: mmap.mmap | None = None  # the file, mapped for checkpoints
        self._threads = [threading.Thread(target=self._serve, args=(q,), daemon=True,
                                          name=f"optimizer-states-{kind}")
                         for kind, q in (("read", self._reads), ("write", self._writes))]
        for thread in self._threads:
            thread.start()

    def views(self, group: int, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """p, m, v of `group` inside `buffer` (laid out as one version in the file)."""
        return region_views(self.regions[group], buffer, self.master_dtype, self.state_dtype)

    def _io(self, group: int, buffer: torch.Tensor, version: int, write: bool) -> None:
        r = self.regions[group]
        part = buffer[:r.version_bytes]
        offset = r.version_offset(version)
        try:
            ticket = (self._file.write_from if write else self._file.read_into)(part, offset)
            ticket.wait()
        except OSError as error:
            what = "write" if write else "read"
            raise DiskStateError(f"optimizer state file {self.path}: {what} failed: "
                                 f"{error.strerror or error}") from error

    # --- start-up, checkpoints -----------------------------------------------------------

    def _chunk_io(self, group: int, lo: int, hi: int, version: int, write: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Elements [lo, hi) of the group's p, m and v between the file's `version` and the
        scratch buffer (lo a multiple of the chunk: every offset stays aligned, each part
        padded as in the file); their views in the scratch buffer."""
        r = self.regions[group]
        views = self._chunk_views(hi - lo)
        starts = (0, round_up(r.p_bytes), round_up(r.p_bytes) + round_up(r.s_bytes))
        base = self._scratch.data_ptr()
        transfer = self._file.write_from if write else self._file.read_into
        try:
            tickets = []
            for view, start in zip(views, starts):
                at = view.data_ptr() - base
                tickets.append(transfer(self._scratch[at:at + round_up(view.nbytes)],
                                        r.version_offset(version) + start
                                        + lo * view.element_size()))
            for ticket in tickets:
                ticket.wait()
        except OSError as error:
            what = "write" if write else "read"
            raise DiskStateError(f"optimizer state file {self.path}: {what} failed: "
                                 f"{error.strerror or error}") from error
        return views

    def each_chunk(self, group: int, run: ChunkRun, staged: bool = False,
                   stage: bool = False) -> None:
        """`run(lo, hi, (p, m, v))` over the group a chunk at a time, in the scratch buffer:
        each chunk read from the committed version (the staged one when `staged`) and,
        when `stage`, written as the staged version after `run` (the group then has a
        staged state)."""
        if staged and not self.versions.staged(group):
            raise RuntimeError(f"optimizer group {group} has no staged state")
        n = self.regions[group].numel
        with self._scratch_lock:
            committed = self.versions.committed(group)
            source = 1 - committed if staged else committed
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                run(lo, hi, self._chunk_io(group, lo, hi, source, write=False))
                if stage:
                    self._chunk_io(group, lo, hi, 1 - committed, write=True)
            if stage:
                self.versions.set_staged(group, True)

    def _chunk_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """p, m, v of `n` elements in the scratch buffer, unread."""
        return tuple(t[:n] for t in region_views(self._scratch_region, self._scratch,
                                                   self.master_dtype, self.state_dtype))

    def write_committed(self, group: int, p: torch.Tensor, m: torch.Tensor | None = None,
                        v: torch.Tensor | None = None) -> None:
        """Set the committed state (m, v zero when not given), synchronously, a chunk at a
        time through the scratch buffer."""
        self.versions.settle(group)
        if self._is_committed_view(group, p):  # a load into committed_views(): in place
            self._mapped.flush()  # on the drive before the next O_DIRECT read of it
            self.versions.set_staged(group, False)
            return
        p, m, v = (None if t is None else t.reshape(-1) for t in (p, m, v))
        n = self.regions[group].numel
        with self._scratch_lock:
            committed = self.versions.committed(group)
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                for dst, src in zip(self._chunk_views(hi - lo), (p, m, v)):
                    dst.copy_(src[lo:hi]) if src is not None else dst.zero_()
                self._chunk_io(group, lo, hi, committed, write=True)
            self.versions.set_staged(group, False)

    def committed_views(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """p, m, v of the committed version as views of the file mapped into memory, after
        the group's pending writes and corrections: a checkpoint reads and loads through
        the page cache, a stage at a time, instead of holding every state in host memory.
        Valid until the group's next commit; a load into them is made durable by
        `write_committed` with them."""
        self.versions.settle(group)
        if self._mapped is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                self._mapped = mmap.mmap(fd, self._file.nbytes)
            finally:
                os.close(fd)
        r = self.regions[group]
        start = r.version_offset(self.versions.committed(group))
        region = torch.frombuffer(self._mapped, dtype=torch.uint8, count=r.version_bytes,
                                  offset=start)
        return self.views(group, region)

    def _is_committed_view(self, group: int, p: torch.Tensor) -> bool:
        if self._mapped is None:
            return False
        r = self.regions[group]
        base = torch.frombuffer(self._mapped, dtype=torch.uint8, count=1).data_ptr()
        return p.data_ptr() == base + r.version_offset(self.versions.committed(group))

    # --- the program's reads and writes --------------------------------------------------

    def request_read(self, group: int) -> None:
        """READ_OPTIMIZER_STATES: returns at once; the step waits in `resident`."""
        self._raise_failure()
        current = self._current[group]
        if current is not None and not current.write_asked:
            raise RuntimeError(f"optimizer group {group} read twice before its write")
        self._current[group] = residency = _Residency()
        asked = self.versions.asked(group)
        self._reads.put(lambda: self._read(group, residency, asked))

    def _read(self, group: int, residency: _Residency, asked: tuple[int, int]) -> None:
        try:
            self.versions.settle(group, asked)
            free = self._free[self.classes[group]]
            buffer = None if self.versions.closed else free.get()
            with self._cond:  # close() sets closed under it: the writer then sees this
                if buffer is None or self.versions.closed:  # closing: take nothing
                    if buffer is not None:
                        free.put(buffer)
                    raise DiskStateError(f"optimizer state file {self.path}: closed")
                residency.buffer = buffer
            self._io(group, buffer, self.versions.committed(group), write=False)
        except BaseException as error:  # noqa: BLE001 - handed to the step that waits
            residency.error = error
        residency.resident.set()

    def resident(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wait for the group's read; its p, m, v in the window (a step's thread)."""
        residency = self._current[group]
        if residency is None:
            raise RuntimeError(f"optimizer group {group} stepped before its "
                               "READ_OPTIMIZER_STATES")
        residency.resident.wait()
        if residency.error is not None:
            raise residency.error
        return self.views(group, residency.buffer)

    def stepped(self, group: int, updated: bool) -> None:
        """The step is over: `updated` says whether the window holds a state to keep (it is
        written as the staged version)."""
        residency = self._current[group]
        if residency is not None:
            residency.updated = updated
            residency.stepped.set()

    def request_write(self, group: int, on_released: Callable[[], None] | None = None) -> None:
        """WRITE_OPTIMIZER_STATES: once the step is over, write its result to the staged
        version and give the buffer back (then `on_released`, if given)."""
        self._raise_failure()
        residency = self._current[group]
        if residency is None or residency.write_asked:
            raise RuntimeError(f"optimizer group {group} written without a read before")
        residency.write_asked = True
        self.versions.write_asked(group)
        self._writes.put(lambda: self._write(group, residency, on_released))

    def _write(self, group: int, residency: _Residency,
               on_released: Callable[[], None] | None) -> None:
        try:
            residency.resident.wait()  # posted after its read: never waits for a later one
            residency.stepped.wait()
            if residency.error is None and residency.updated:
                self._io(group, residency.buffer, 1 - self.versions.committed(group),
                         write=True)
                self.versions.set_staged(group, True)
        except BaseException as error:  # noqa: BLE001 - raised on the main thread
            self._failure = self._failure or error
        finally:
            with self._cond:
                buffer, residency.buffer = residency.buffer, None
            if on_released is not None:
                on_released()
            if buffer is not None:
                self._free[self.classes[group]].put(buffer)
            self.versions.write_done(group)

    def wait_written(self, group: int) -> None:
        """Wait for the group's staged write (a correction rewrites the same bytes)."""
        self.versions.wait_written(group)

    def settle_all(self) -> None:
        for group in range(len(self.versions)):
            self.versions.settle(group)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _serve(self, requests: queue.Queue) -> None:
        while True:
            job = requests.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        """Stop the threads, remove the file (idempotent). After a failed iteration the
        threads may wait for a step that will never run: they are woken and give up."""
        if self.versions.closed:
            return
        self.versions.close()
        for q in (self._reads, self._writes):
            q.put(None)
        for free in self._free.values():
            free.put(None)  # a read waiting for a buffer
        for residency in self._current:
            if residency is not None:
                residency.error = residency.error or DiskStateError(
                    f"optimizer state file {self.path}: closed")
                residency.resident.set()
                residency.stepped.set()
        for thread in self._threads:
            thread.join()
        if self._mapped is not None:
            try:
                self._mapped.close()
            except BufferError:  # a checkpoint's views still point into it: unmapped later
                pass
        self._file.close(unlink=True)
        self._tracker.untrack(self.path)
