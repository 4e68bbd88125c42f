"""What the kernel says a process holds in host memory, for the measurements that check the
project's own books (bench/host_memory.py, the memory tests).

- `memory_status`: /proc/PID/status's resident figures (anonymous, shared-memory and
  file pages, and the peak resident size VmHWM);
- `reset_peak`: restart VmHWM from the current size (/proc/PID/clear_refs, "5"), so that
  the peak of each phase of a run is the kernel's own, not a sampler's;
- `resident_bytes`: how much of some address ranges (tensors' storages, say) is resident
  (mincore(2) over their pages, each page counted once): memory that was allocated but
  never touched is not;
- `malloc_free_bytes`: what glibc's malloc keeps of freed memory (mallinfo2's fordblks):
  resident until it is reused or trimmed.

Linux only (the project's platform); None where a figure does not exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable

PAGE = os.sysconf("SC_PAGE_SIZE")
STATUS_FIELDS = {"RssAnon": "anon", "RssShmem": "shmem", "RssFile": "file", "VmHWM": "peak",
                 "VmRSS": "rss"}


def memory_status(pid: int | str = "self") -> dict[str, int]:
    """{anon, shmem, file, rss, peak} in bytes from /proc/PID/status (peak: VmHWM, the
    largest rss since the start or the last `reset_peak`)."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int | str = "self") -> None:
    """Restart the kernel's peak resident size (VmHWM) at the current size."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _page_ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (address, bytes) spans as page-aligned [lo, hi) ranges, merged."""
    pages = sorted((address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE)
                   for address, nbytes in spans if nbytes > 0)
    merged: list[tuple[int, int]] = []
    for lo, hi in pages:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0 of a resident page's byte


def resident_bytes(spans: Iterable[tuple[int, int]]) -> int:
    """Resident bytes of the (address, bytes) spans of this process's memory, each page
    once."""
    total = 0
    for lo, hi in _page_ranges(spans):
        pages = (hi - lo) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        total += bytes(vec).translate(_LOW_BIT).count(1) * PAGE
    return total


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_free_bytes() -> int | None:
    """Freed bytes glibc's malloc keeps in its arenas (None without glibc's mallinfo2)."""
    mallinfo2 = getattr(_libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)
