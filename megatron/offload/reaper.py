"""Removes a process's shared-memory segments (and its optimizer state files) once that
process is gone, however it died.

Run as a separate process (`python -I reaper.py`) in its own session, started by the
first segment a process creates. It reads lines on stdin: "+PID PATH" tracks a segment,
"-PID PATH" forgets it. The pipe reaches EOF when its parent exits for any reason,
SIGKILL included; then every tracked file still owned by PID (read from its header, so
a segment re-created by a new run is left alone) is unlinked. Imports only the stdlib
and its sibling shm_header.py (stdlib only too), which it finds next to itself.
"""

from __future__ import annotations

import os
import re
import signal
import sys

if __package__:  # imported as megatron.offload.reaper
    from megatron.offload.shm_header import owner_pid
else:  # run as a script with -I, which leaves the script's own directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from shm_header import owner_pid


# An optimizer state file (megatron/optimizer/disk_states.py) names its creator's pid; it
# has no header, since its bytes are read and written with O_DIRECT.
_STATE_FILE = re.compile(r"\.pid(\d+)\.optstate$")


def _file_owner(path: str) -> int | None:
    match = _STATE_FILE.search(os.path.basename(path))
    return int(match.group(1)) if match else owner_pid(path)


def reap(tracked: dict[str, int]) -> None:
    """Unlink each tracked segment or state file still owned by the pid that tracked it."""
    for path, pid in tracked.items():
        if _file_owner(path) == pid:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def main() -> None:
    """Track segments from stdin until EOF (the parent is gone), then reap them."""
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
