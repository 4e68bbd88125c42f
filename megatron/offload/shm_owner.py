"""Who owns a shared-memory segment, whether that process still runs, and stale removal.

A segment's header names its creator by pid and start time (pid reuse excluded), so any
process can tell a live job's segment from one a dead process left behind. Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron.offload.shm_header import read_header


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


def remove_if_stale(path: str) -> bool:
    """Unlink a segment whose creator is dead; True if it was removed. Another user's
    segment in a sticky /dev/shm is theirs to remove (PermissionError): left alone."""
    header = read_header(path)
    if header is None or owner_alive(header["pid"], header["start_time"]):
        return False
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True
