"""This process's side of the reaper: start it, tell it which segments to remove on death.

One reaper process (reaper.py) per creating process, started with its first segment and
fed over a pipe; see reaper.py for what it does when the pipe closes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path

# A path, not an import: the reaper runs as a script in its own interpreter.
REAPER_SCRIPT = str(Path(__file__).with_name("reaper.py"))


class _ReaperClient:
    """One reaper process per creating process, started with its first segment."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = -1
        self._tracked: set[str] = set()
        self._lock = threading.Lock()

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            # -I: no PYTHON* variables, user site or cwd can change what the reaper runs
            [sys.executable, "-I", REAPER_SCRIPT],
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
        """Have the reaper remove `path` if this process dies without releasing it."""
        if self._pid == os.getpid():
            self._tracked.add(path)  # first, so that a restarted reaper gets it too
        self._send(f"+{os.getpid()} {path}\n")
        self._tracked.add(path)

    def untrack(self, path: str) -> None:
        """`path` was removed by this process: the reaper can forget it."""
        if self._proc is not None and self._pid == os.getpid():
            self._tracked.discard(path)
            self._send(f"-{os.getpid()} {path}\n")

    def stop(self) -> None:
        """Close the pipe (the reaper removes what is still tracked) and wait for it."""
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
