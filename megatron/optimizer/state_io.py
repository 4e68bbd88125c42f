"""Optimizer states in files on a fast disk: aligned host buffers, files opened with O_DIRECT
(buffered where the filesystem refuses it), and tickets for reads and writes in flight.

The transfers run on a pool of C++ threads doing pread/pwrite (megatron.optimizer._state_io):
a request is cut into chunks so several are in flight at once, and waiting releases the GIL.

    engine = shared_engine()
    f = StateFile("/nvme/rank0.m", nbytes, engine)
    buf = aligned_empty(f.nbytes)
    f.write_from(buf, 0).wait()
    f.read_into(buf, 0).wait()
    f.close()
"""

from __future__ import annotations

import os
import tempfile
import threading

import torch
from megatron.optimizer._state_io import Engine, close_file, open_file

__all__ = ["ALIGNMENT", "Engine", "StateFile", "Ticket", "aligned_empty", "direct_io_supported",
           "disk_free_bytes", "round_up", "shared_engine"]

ALIGNMENT = 4096  # O_DIRECT's alignment of address, size and offset


def round_up(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGNMENT."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host tensor of round_up(nbytes) bytes at a 4096-aligned address."""
    size = round_up(nbytes)
    base = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
    start = -base.data_ptr() % ALIGNMENT
    return base[start:start + size]  # the view keeps base's storage alive


class Ticket:
    """A read or write in flight; keeps its buffer referenced until waited."""

    def __init__(self, engine: Engine, ticket: int, buffer: torch.Tensor) -> None:
        self._engine = engine
        self._ticket = ticket
        self._buffer: torch.Tensor | None = buffer
        self._lock = threading.Lock()
        self._error: OSError | None = None

    def wait(self) -> None:
        """Blocks until the transfer completed; raises OSError if it failed. Any thread may
        call it, any number of times: later calls repeat the first outcome."""
        with self._lock:  # the engine forgets a ticket once waited: one thread asks it
            if self._buffer is not None:
                try:
                    self._engine.wait(self._ticket)
                except OSError as e:
                    self._error = e
                finally:
                    self._buffer = None
        if self._error is not None:
            raise self._error

    def __del__(self) -> None:
        # dropped unwaited: the threads may still use the buffer, so hold it until they finish
        if getattr(self, "_buffer", None) is not None:
            try:
                self.wait()
            except OSError:
                pass

    def done(self) -> bool:
        """Whether the transfer completed, without blocking."""
        if self._buffer is None:
            return True
        try:
            return self._engine.done(self._ticket)
        except KeyError:  # another thread's wait() just collected it
            return True


class StateFile:
    """A file of nbytes (rounded up to ALIGNMENT) holding optimizer states."""

    def __init__(self, path: str | os.PathLike, nbytes: int, engine: Engine,
                 direct: bool = True) -> None:
        self.path = os.fspath(path)
        self.nbytes = round_up(nbytes)
        self._engine = engine
        existed = os.path.exists(self.path)
        try:
            self._fd: int | None
            self._fd, self.direct = open_file(self.path, self.nbytes, direct)
        except OSError:
            if not existed:  # do not leave a half-reserved file behind
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            raise

    @property
    def fd(self) -> int:
        """The open file descriptor, for Engine.submit."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        return self._fd

    def _submit(self, buffer: torch.Tensor, offset: int, write: bool) -> Ticket:
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"buffer must be a contiguous uint8 host tensor, not {buffer.dtype} "
                             f"on {buffer.device} (contiguous={buffer.is_contiguous()})")
        fd = self.fd
        nbytes = buffer.numel()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) lie outside {self.path}'s "
                             f"{self.nbytes} bytes")
        ticket = self._engine.submit(fd, buffer.data_ptr(), nbytes, offset, write)
        return Ticket(self._engine, ticket, buffer)

    def read_into(self, buffer: torch.Tensor, offset: int) -> Ticket:
        """Starts reading buffer.numel() bytes at offset into buffer."""
        return self._submit(buffer, offset, write=False)

    def write_from(self, buffer: torch.Tensor, offset: int) -> Ticket:
        """Starts writing buffer's bytes at offset."""
        return self._submit(buffer, offset, write=True)

    def close(self, unlink: bool = True) -> None:
        """Closes the file and, with unlink, removes it. Idempotent. Wait every ticket first."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            close_file(fd)
            if unlink:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> StateFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_engines: dict[tuple[int, int], Engine] = {}
_engines_lock = threading.Lock()
_inherited: list[Engine] = []


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's engine threads: it starts its own engines.
    # The inherited ones are kept, never destroyed, since their destructor would join
    # threads that do not exist in the child.
    global _engines_lock
    _inherited.extend(_engines.values())
    _engines.clear()
    _engines_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_engine(threads: int = 4, chunk_bytes: int = 1 << 20) -> Engine:
    """The process-wide engine of this configuration, started on first use (again in a
    forked child)."""
    with _engines_lock:
        engine = _engines.get((threads, chunk_bytes))
        if engine is None:
            engine = _engines[(threads, chunk_bytes)] = Engine(threads, chunk_bytes)
        return engine


def direct_io_supported(directory: str) -> bool:
    """Whether files in directory can be opened with O_DIRECT (tries a temporary file)."""
    fd, path = tempfile.mkstemp(prefix=".direct-probe-", dir=directory)
    os.close(fd)
    try:
        probe, direct = open_file(path, 0, True)
        close_file(probe)
        return direct
    finally:
        os.unlink(path)


def disk_free_bytes(directory: str) -> int:
    """Bytes an unprivileged user may still write on directory's filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
