"""Removes a process's shared-memory segments once that process is gone, however it died.

Run as a separate process (`python -I reaper.py`) in its own session, started by the
first segment a process creates. It reads lines on stdin: "+PID PATH" tracks a segment,
"-PID PATH" forgets it. The pipe reaches EOF when its parent exits for any reason,
SIGKILL included; then every tracked file still owned by PID (read from its header, so
a segment re-created by a new run is left alone) is unlinked. Imports only the stdlib.
"""

from __future__ import annotations

import os
import signal
import struct
import sys

# Header layout shared with megatron/offload/shm.py: magic, then int64 fields.
MAGIC = b"MLMSHM01"
OWNER_PID_OFFSET = 24


def owner_pid(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            head = f.read(OWNER_PID_OFFSET + 8)
    except OSError:
        return None
    if len(head) < OWNER_PID_OFFSET + 8 or head[:8] != MAGIC:
        return None
    return struct.unpack_from("<q", head, OWNER_PID_OFFSET)[0]


def reap(tracked: dict[str, int]) -> None:
    for path, pid in tracked.items():
        if owner_pid(path) == pid:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends the parent; we clean after it
    tracked: dict[str, int] = {}
    for line in sys.stdin:
        op, pid, path = line[0], line[1:].split(" ", 1)[0], line[1:].split(" ", 1)[1].rstrip("\n")
        if op == "+":
            tracked[path] = int(pid)
        elif op == "-":
            tracked.pop(path, None)
    reap(tracked)


if __name__ == "__main__":
    main()
