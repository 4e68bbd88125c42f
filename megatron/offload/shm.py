"""One POSIX shared-memory segment holding a flat parameter buffer, with a version protocol.

A segment is a file in /dev/shm (what shm_open creates on Linux) mapped into every
local process that runs the stage: tensors are views of the mapping, never copies.
Layout: a 4 KiB header, then the flat buffer (page-aligned, so it can be registered for
DMA). Header (little-endian int64 after an 8-byte magic):

    0 magic | 8 version | 16 writing | 24 owner pid | 32 owner start time
    40 numel | 48 dtype code

Protocol: the writer sets `writing`, writes the parameters, then stores the new
`version` and clears `writing`; a reader waits for `version >= v` with `writing == 0`.
x86 keeps stores in order, so a reader that sees the version sees the data.
Ownership: the creator's pid and start time are in the header, so a segment whose
creator is dead is recognised as stale (and removed) by anyone, and a reaper process
removes it if its creator is killed (see reaper.py).
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from megatron.offload import reaper

HEADER_BYTES = 4096
MAGIC = reaper.MAGIC
_VERSION, _WRITING, _PID, _START, _NUMEL, _DTYPE = 8, 16, 24, 32, 40, 48
NO_VERSION = -1
DEFAULT_SHM_DIR = "/dev/shm"

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class ShmSpaceError(MemoryError):
    """Not enough free space in the shared-memory file system."""


class SegmentInUseError(RuntimeError):
    """A segment with this name belongs to a live process (another job with the same id?)."""


# processes --------------------------------------------------------------------------
def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):  # killed but not yet reaped by its parent: dead
        return None
    return int(fields[19])


def owner_alive(pid: int, start_time: int) -> bool:
    """True when the process that created a segment still runs (pid reuse excluded)."""
    return process_start_time(pid) == start_time


# free space -------------------------------------------------------------------------
def free_bytes(shm_dir: str = DEFAULT_SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check_space(required_bytes: int, shm_dir: str = DEFAULT_SHM_DIR, what: str = "") -> None:
    """Fail before creating anything when `shm_dir` cannot hold `required_bytes`."""
    available = free_bytes(shm_dir)
    if required_bytes > available:
        raise ShmSpaceError(
            f"{shm_dir} has {available} bytes free but {what or 'the parameter store'} needs "
            f"{required_bytes} bytes; enlarge it (Docker: --shm-size, e.g. --shm-size="
            f"{-(-required_bytes // 2**30) + 1}g; a host: mount -o remount,size=... {shm_dir})"
        )


def segment_bytes(numel: int, dtype: torch.dtype) -> int:
    return HEADER_BYTES + numel * torch.empty((), dtype=dtype).element_size()


# the reaper client ------------------------------------------------------------------
class _ReaperClient:
    """One reaper process per creating process, started with its first segment."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = -1
        self._tracked: set[str] = set()
        self._lock = threading.Lock()

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", reaper.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # survives a kill of our process group
        )
        self._pid = os.getpid()

    def _write(self, text: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(text.encode())
        self._proc.stdin.flush()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pid != os.getpid():  # none yet, or we are a forked child
                self._tracked = set()
                self._start()
            try:
                self._write(line)
            except BrokenPipeError:  # the reaper was killed: start another, re-track all
                self._start()
                self._write("".join(f"+{self._pid} {path}\n" for path in self._tracked))

    def track(self, path: str) -> None:
        if self._pid == os.getpid():
            self._tracked.add(path)  # first, so that a restarted reaper gets it too
        self._send(f"+{os.getpid()} {path}\n")
        self._tracked.add(path)

    def untrack(self, path: str) -> None:
        if self._proc is not None and self._pid == os.getpid():
            self._tracked.discard(path)
            self._send(f"-{os.getpid()} {path}\n")

    def stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and self._pid == os.getpid():
                assert proc.stdin is not None
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                proc.wait(timeout=10)
            self._pid = -1
            self._tracked = set()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


REAPER = _ReaperClient()
atexit.register(REAPER.stop)


# segments ---------------------------------------------------------------------------
def read_header(path: str) -> dict[str, int] | None:
    """Header fields of a segment file, or None when it is not (yet) a complete segment."""
    try:
        with open(path, "rb") as f:
            head = f.read(56)
    except OSError:
        return None
    if len(head) < 56 or head[:8] != MAGIC:
        return None
    keys = ("version", "writing", "pid", "start_time", "numel", "dtype")
    return dict(zip(keys, struct.unpack_from("<6q", head, 8)))


def remove_if_stale(path: str) -> bool:
    """Unlink a segment whose creator is dead; True if it was removed."""
    header = read_header(path)
    if header is None or owner_alive(header["pid"], header["start_time"]):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class SharedSegment:
    """A mapped segment: `params` is a zero-copy flat tensor view of its buffer."""

    def __init__(self, path: str, mm: mmap.mmap, numel: int, dtype: torch.dtype, owner: bool):
        self.path = path
        self.name = os.path.basename(path)
        self.numel = numel
        self.dtype = dtype
        self.owner = owner
        self._creator_pid = os.getpid()  # a forked child must not remove its parent's files
        self._mm: mmap.mmap | None = mm
        self.params = torch.frombuffer(mm, dtype=dtype, count=numel, offset=HEADER_BYTES)

    # creation and attach ------------------------------------------------------------
    @classmethod
    def create(
        cls, path: str, numel: int, dtype: torch.dtype, shm_dir: str = DEFAULT_SHM_DIR
    ) -> SharedSegment:
        """Create, size and map a segment; the calling process owns it."""
        if numel <= 0:
            raise ValueError(f"numel={numel}: a segment needs at least one element")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype={dtype}: expected one of {list(DTYPE_CODES)}")
        nbytes = segment_bytes(numel, dtype)
        check_space(nbytes, shm_dir, what=f"segment {os.path.basename(path)}")
        fd = cls._create_exclusive(path)
        try:
            # fallocate reserves the tmpfs pages now: a full /dev/shm fails here with
            # ENOSPC instead of killing a process with SIGBUS at its first write.
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise ShmSpaceError(
                f"could not reserve {nbytes} bytes for {path} ({exc}); free "
                f"{free_bytes(shm_dir)} bytes in {shm_dir}; enlarge it (Docker: --shm-size)"
            ) from exc
        os.close(fd)
        pid = os.getpid()
        start = process_start_time(pid)
        assert start is not None
        struct.pack_into("<6q", mm, 8, NO_VERSION, 0, pid, start, numel, DTYPE_CODES[dtype])
        mm[0:8] = MAGIC  # last: readers treat the header as valid from here on
        REAPER.track(path)
        return cls(path, mm, numel, dtype, owner=True)

    @staticmethod
    def _create_exclusive(path: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        header = read_header(path)
        if header is not None and owner_alive(header["pid"], header["start_time"]):
            raise SegmentInUseError(
                f"shared-memory segment {path} belongs to live process {header['pid']}: "
                "another job with the same job id is running on this node; give this job "
                "another id (--rdzv-id / MASTER_PORT) or stop the other one"
            ) from None
        warnings.warn(
            f"removing stale shared-memory segment {path} left by a dead process "
            f"{header['pid'] if header else '(unknown)'}",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    @classmethod
    def attach(
        cls,
        path: str,
        numel: int | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 60.0,
    ) -> SharedSegment:
        """Map an existing segment, waiting up to `timeout_s` for its creator."""
        deadline = time.monotonic() + timeout_s
        delay = 1e-4
        while (header := read_header(path)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shared-memory segment {path} did not appear within timeout_s={timeout_s}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        found_dtype = CODE_DTYPES.get(header["dtype"])
        if (numel is not None and header["numel"] != numel) or (
            dtype is not None and found_dtype != dtype
        ):
            raise ValueError(
                f"segment {path} holds {header['numel']} x {found_dtype}, "
                f"expected {numel} x {dtype}: a layout mismatch between ranks"
            )
        assert found_dtype is not None
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), segment_bytes(header["numel"], found_dtype))
        return cls(path, mm, header["numel"], found_dtype, owner=False)

    # version protocol ---------------------------------------------------------------
    def _field(self, offset: int) -> int:
        assert self._mm is not None, f"segment {self.name} is released"
        return struct.unpack_from("<q", self._mm, offset)[0]

    def _set(self, offset: int, value: int) -> None:
        assert self._mm is not None, f"segment {self.name} is released"
        struct.pack_into("<q", self._mm, offset, value)

    @property
    def version(self) -> int:
        """The last published version, NO_VERSION (-1) before the first publish."""
        return self._field(_VERSION)

    def begin_write(self) -> None:
        """Mark the parameters as being rewritten (readers wait until `publish`)."""
        self._set(_WRITING, 1)

    def publish(self, version: int) -> None:
        """Make the written parameters visible as `version` (must increase)."""
        current = self.version
        if version <= current:
            raise ValueError(f"publish(version={version}) on {self.name}: already at {current}")
        self._set(_VERSION, version)
        self._set(_WRITING, 0)

    def write(self, flat: torch.Tensor, version: int) -> None:
        """Copy `flat` into the segment and publish it as `version`."""
        self.begin_write()
        self.params.copy_(flat.reshape(-1))
        self.publish(version)

    def wait_version(self, min_version: int, timeout_s: float = 60.0) -> int:
        """Block until a version >= `min_version` is published; returns that version."""
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while True:
            version = self._field(_VERSION)
            if version >= min_version and self._field(_WRITING) == 0:
                return version
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"segment {self.name} stayed at version {version} (< {min_version}) "
                    f"for timeout_s={timeout_s}: is its writer alive?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    # release ------------------------------------------------------------------------
    def release(self) -> None:
        """Unmap; the owner also removes the file. Views still alive keep the mapping."""
        if self._mm is None:
            return
        if self.owner and os.getpid() == self._creator_pid:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            REAPER.untrack(self.path)
        self.params = torch.empty(0, dtype=self.dtype)
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes with the last view

    @property
    def released(self) -> bool:
        return self._mm is None
