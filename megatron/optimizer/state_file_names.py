"""Names of the optimizer state files (--optimizer-state-location nvme): after the host,
the job, the rank and the pid, so two jobs never share one, and a file whose process is
gone can be found and removed at the next start (the reaper removes it when its process
dies, megatron/offload/reaper.py, which matches the same name)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

STATE_FILE_SUFFIX = ".optstate"
_NAME = re.compile(r"^megatron-(?P<host>[^.]+)\.(?P<job>[^.]+)\.rank(?P<rank>\d+)"
                   r"\.pid(?P<pid>\d+)" + re.escape(STATE_FILE_SUFFIX) + "$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def state_file_name(job: str, rank: int, pid: int | None = None) -> str:
    """The file of one rank of one job on this host (two jobs never share a name: the pid
    is unique among live processes of a host)."""
    job = re.sub(r"[^A-Za-z0-9_-]", "_", job)[:64] or "job"
    return f"megatron-{_HOST}.{job}.rank{rank}.pid{os.getpid() if pid is None else pid}" \
           f"{STATE_FILE_SUFFIX}"


def state_file_owner(path: str | os.PathLike) -> int | None:
    """The pid a state file's name says created it, None for another name or host."""
    match = _NAME.match(Path(path).name)
    if match is None or match["host"] != _HOST:
        return None
    return int(match["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str | os.PathLike) -> list[str]:
    """Remove this host's state files whose process is gone (a job killed before its
    reaper ran, e.g. by a reboot); returns their paths."""
    removed = []
    for entry in os.scandir(directory):
        pid = state_file_owner(entry.name)
        if pid is not None and not _alive(pid):
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except (FileNotFoundError, PermissionError):  # gone, or another user's to remove
                pass
    return removed
