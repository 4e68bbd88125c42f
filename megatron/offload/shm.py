"""One POSIX shared-memory segment holding a flat parameter buffer, with a version protocol.

A segment is a file in /dev/shm (what shm_open creates on Linux) mapped into every
local process that runs the stage: tensors are views of the mapping, never copies.
Layout: a 4 KiB header (shm_header.py), then the flat buffer (page-aligned, so it can be
registered for DMA).

Protocol: the writer sets `writing`, writes the parameters, then stores the new
`version` and clears `writing`; a reader waits for `version >= v` with `writing == 0`.
x86 keeps stores in order, so a reader that sees the version sees the data.
Ownership: the creator's pid and start time are in the header, so a segment whose
creator is dead is recognised as stale (and removed) by anyone (shm_owner.py), and a
reaper process removes it if its creator is killed (reaper_client.py, reaper.py).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings

import torch

import megatron.offload.host_pinning as host_pinning
import megatron.offload.shm_header as shm_header
from megatron.offload.reaper_client import REAPER
from megatron.offload.shm_header import HEADER_BYTES, read_header
from megatron.offload.shm_owner import owner_alive, process_start_time
from megatron.offload.shm_space import (
    DEFAULT_SHM_DIR,
    ShmSpaceError,
    check_space,
    free_bytes,
    segment_bytes,
)

DTYPE_CODES = {getattr(torch, name): code for name, code in shm_header.DTYPE_CODES.items()}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class SegmentInUseError(RuntimeError):
    """A segment with this name belongs to a live process (another job with the same id?)."""


class SharedSegment:
    """A mapped segment: `params` is a zero-copy flat tensor view of its buffer."""

    def __init__(
        self, path: str, mm: mmap.mmap, numel: int, dtype: torch.dtype, owner: bool
    ) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.numel = numel
        self.dtype = dtype
        self.owner = owner
        self._creator_pid = os.getpid()  # a forked child must not remove its parent's files
        self._mm: mmap.mmap | None = mm
        self.params = torch.frombuffer(mm, dtype=dtype, count=numel, offset=HEADER_BYTES)
        # On CUDA the whole mapping is page-locked so that prefetches use the copy engine.
        self._base = self.params.data_ptr() - HEADER_BYTES
        self.pinned = host_pinning.register(self._base, len(mm))

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
        shm_header.write_header(
            mm, pid=pid, start_time=start, numel=numel, dtype_code=DTYPE_CODES[dtype]
        )
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
    def _field(self, name: str) -> int:
        assert self._mm is not None, f"segment {self.name} is released"
        return shm_header.get_field(self._mm, name)

    def _set(self, name: str, value: int) -> None:
        assert self._mm is not None, f"segment {self.name} is released"
        shm_header.set_field(self._mm, name, value)

    @property
    def version(self) -> int:
        """The last published version, NO_VERSION (-1) before the first publish."""
        return self._field("version")

    def begin_write(self) -> None:
        """Mark the parameters as being rewritten (readers wait until `publish`)."""
        self._set("writing", 1)

    def publish(self, version: int, republish: bool = False) -> None:
        """Make the written parameters visible as `version` (must increase; `republish`:
        or stay, for a checkpoint loaded over version 0 before training reads it)."""
        current = self.version
        if version < current or (version == current and not republish):
            raise ValueError(f"publish(version={version}) on {self.name}: already at {current}")
        self._set("version", version)
        self._set("writing", 0)

    def write(self, flat: torch.Tensor, version: int, republish: bool = False) -> None:
        """Copy `flat` into the segment and publish it as `version`."""
        self.begin_write()
        self.params.copy_(flat.reshape(-1))
        self.publish(version, republish)

    def wait_version(self, min_version: int, timeout_s: float = 60.0) -> int:
        """Block until a version >= `min_version` is published; returns that version."""
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while True:
            version = self._field("version")
            if version >= min_version and self._field("writing") == 0:
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
        if self.pinned:
            host_pinning.unregister(self._base)
            self.pinned = False
        self.params = torch.empty(0, dtype=self.dtype)
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes with the last view

    @property
    def released(self) -> bool:
        return self._mm is None
