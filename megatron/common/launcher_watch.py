"""A training process never outlives the process that launched it (torchrun's agent, srun,
the shell of a one-process run).

Slurm, an OOM killer or a user may SIGKILL torchrun's agent: its workers would go on
training as orphans, and a relaunch of the same command would meet them in the same
--save directory. A daemon thread polls the parent pid (getppid changes when the parent
dies and the process is re-parented); when it changes, the process says so in one line and
ends at once with os._exit: its peers may already be gone, so nothing collective can run.
What it leaves is released by others: the reaper removes its shared-memory segments and
optimizer state files, the kernel its --save lock, and the next job's first save the
staging directory of a save it interrupted. PR_SET_PDEATHSIG is not used: it fires when
the parent's *thread* that forked the process exits, which a launcher does not promise.

Imports only the standard library (the test starts it in a bare interpreter).
"""

from __future__ import annotations

import os
import sys
import threading
import time

LAUNCHER_DIED_STATUS = 1
_started = False


def watch_launcher(interval_s: float = 0.5, rank: int | None = None) -> bool:
    """Start the watch (once per process); False when there is no parent to watch (the
    process was started by init, e.g. as a container's entry point)."""
    global _started
    parent = os.getppid()
    if _started or parent <= 1:
        return _started
    _started = True
    who = f"rank {rank}" if rank is not None else f"pid {os.getpid()}"

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        try:
            os.write(sys.stderr.fileno(),
                     f"pretrain_llama.py: error: {who}: its launcher (pid {parent}) died; "
                     "stopping\n".encode())
        finally:
            os._exit(LAUNCHER_DIED_STATUS)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return True
