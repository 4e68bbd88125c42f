"""The byte layout of a shared-memory segment's header: the one place that knows it.

Stdlib only: the reaper process (reaper.py, run with `python -I`, no torch, no repository
on sys.path) loads this file as a sibling module, and the store (shm.py) imports it as
part of the package. Layout (little-endian int64 fields after an 8-byte magic):

    0 magic | 8 version | 16 writing | 24 owner pid | 32 owner start time
    40 numel | 48 dtype code

then zero padding up to HEADER_BYTES, where the flat buffer starts (page-aligned, so it
can be registered for DMA).
"""

from __future__ import annotations

import mmap
import struct

MAGIC = b"MLMSHM01"
HEADER_BYTES = 4096
FIELDS = ("version", "writing", "pid", "start_time", "numel", "dtype")
FIELDS_OFFSET = len(MAGIC)
_FIELDS_FORMAT = f"<{len(FIELDS)}q"
OFFSETS = {name: FIELDS_OFFSET + 8 * i for i, name in enumerate(FIELDS)}
USED_BYTES = FIELDS_OFFSET + struct.calcsize(_FIELDS_FORMAT)  # 56: the rest is padding

NO_VERSION = -1  # `version` of a segment that was never published

# Element types by torch name (torch.<name>); shm.py maps them to torch dtypes.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "uint8": 4}

# What struct reads from / writes into: a segment's mmap, or bytes read from its file.
WritableBuffer = bytearray | memoryview | mmap.mmap
Buffer = bytes | WritableBuffer


def write_header(
    buf: WritableBuffer, *, pid: int, start_time: int, numel: int, dtype_code: int
) -> None:
    """Initialise a new segment's header: no version yet, not writing, owned by `pid`."""
    struct.pack_into(
        _FIELDS_FORMAT, buf, FIELDS_OFFSET, NO_VERSION, 0, pid, start_time, numel, dtype_code
    )
    buf[0 : len(MAGIC)] = MAGIC  # last: readers treat the header as valid from here on


def unpack_header(head: Buffer) -> dict[str, int] | None:
    """Header fields from a segment's first bytes, or None when not a complete header."""
    if len(head) < USED_BYTES or head[: len(MAGIC)] != MAGIC:
        return None
    return dict(zip(FIELDS, struct.unpack_from(_FIELDS_FORMAT, head, FIELDS_OFFSET)))


def _read_prefix(path: str, nbytes: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(nbytes)
    except OSError:
        return None


def read_header(path: str) -> dict[str, int] | None:
    """Header fields of a segment file, or None when it is not (yet) a complete segment."""
    head = _read_prefix(path, USED_BYTES)
    return None if head is None else unpack_header(head)


def owner_pid(path: str) -> int | None:
    """The creating pid of a segment file, or None when it is not (yet) a segment.

    Reads only up to the pid field: all the reaper needs to tell its parent's segment
    from one that a new run created under the same name.
    """
    end = OFFSETS["pid"] + 8
    head = _read_prefix(path, end)
    if head is None or len(head) < end or head[: len(MAGIC)] != MAGIC:
        return None
    return struct.unpack_from("<q", head, OFFSETS["pid"])[0]


def get_field(buf: Buffer, name: str) -> int:
    """One int64 header field of a mapped segment."""
    return struct.unpack_from("<q", buf, OFFSETS[name])[0]


def set_field(buf: WritableBuffer, name: str, value: int) -> None:
    """Store one int64 header field of a mapped segment (an aligned 8-byte store)."""
    struct.pack_into("<q", buf, OFFSETS[name], value)
