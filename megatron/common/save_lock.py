"""One job per --save directory at a time (the lock; megatron/training/save_lock.py takes
it for a run).

Two jobs saving into one directory destroy each other's checkpoints: each removes the
staging directories it finds (those of a save killed mid-write, as it believes) and
replaces the tracker. So rank 0 of a job holds `DIR/.megatron-save.lock` from its start to
its end: an exclusive flock on it, and in it the holder's identity (host, pid, the job id
of torchrun or Slurm, the start time) for the message a second job prints. The kernel
releases a flock when its process dies however it died, so the lock of a killed job is
free at once, and the next job takes it over (its identity is overwritten). A directory
that is in use is bad input: one line naming the holder, exit status 2, nothing created
or removed. Standard library only (a test holds a lock from a bare interpreter).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

LOCK_NAME = ".megatron-save.lock"


class LockError(Exception):
    """The directory cannot be locked: `reason` says why (one line, without the path)."""

    def __init__(self, directory: str, reason: str) -> None:
        self.directory, self.reason = directory, reason
        super().__init__(f"{directory}: {reason}")


def job_identity() -> dict:
    """Who this process is, as a second job's message says it."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())}


def describe(holder: dict) -> str:
    job = f"job {holder['job']}, " if holder.get("job") else ""
    return (f"{job}pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}")


class SaveLock:
    """The lock of one --save directory, held from `acquire` to `release`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None
        self._created: list[str] = []  # the directories acquire() made, deepest first

    def acquire(self) -> dict | None:
        """Take the lock (creating the directory when needed); returns the identity of a
        dead holder it took over, None when it was free. Raises LockError when another
        live job holds it (or the directory cannot be written)."""
        if not os.path.isdir(self.directory):
            missing, path = [], os.path.abspath(self.directory)
            while not os.path.exists(path):
                missing.append(path)
                path = os.path.dirname(path)
            try:
                os.makedirs(self.directory)
                self._created = missing
            except OSError as exc:
                raise LockError(self.directory, f"expected a directory that can be created "
                                                f"({exc.strerror})") from None
        for _ in range(5):  # the file may be replaced between our open and our flock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise LockError(self.directory, f"expected a writable directory "
                                                f"({exc.strerror} creating {LOCK_NAME})"
                                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise LockError(self.directory, f"in use by another running job "
                                                f"({describe(holder)}); expected a directory "
                                                "no other job saves to") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and removed by its holder meanwhile: open it anew
                os.close(fd)
                continue
            previous = _read(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(job_identity()) + "\n").encode(), 0)
            self._fd = fd
            return previous or None
        raise LockError(self.directory, f"expected a lock file that stays put ({LOCK_NAME} "
                                        "kept being replaced)")

    def held(self) -> bool:
        """Whether the lock file at its path is still the one this lock holds: False once
        the directory (or the file) was removed during the run, or replaced by another
        job's."""
        return self._fd is not None and self._is_ours(self._fd)

    def retake(self) -> dict | None:
        """Let go of a lock whose file is gone (held() is False) and take the directory's
        lock anew, creating the directory; LockError when another job holds it now."""
        if self._fd is not None:
            os.close(self._fd)  # its file is no longer at the path: nothing to unlink
            self._fd = None
        self._created = []
        return self.acquire()

    def release(self) -> None:
        """Remove the lock file and let go (idempotent); the directories this job created
        go too while they are empty (nothing was saved: a run stopped by a later check
        leaves no empty directory). A directory that turned read-only, or went away,
        keeps what it has: the descriptor is closed whatever happens, and the kernel's
        lock goes with it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._is_ours(fd):  # never another job's file at the same path
                with contextlib.suppress(OSError):  # read-only now, or removed meanwhile
                    os.unlink(self.path)  # while still holding it: no one owns the old file
        finally:
            os.close(fd)
        for directory in self._created:
            try:
                os.rmdir(directory)  # only when empty
            except OSError:
                break
        self._created = []

    def _is_ours(self, fd: int) -> bool:
        """The file at the lock's path is the one open as `fd`."""
        try:
            found, ours = os.stat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == (ours.st_dev, ours.st_ino)


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}
