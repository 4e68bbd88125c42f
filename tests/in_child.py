"""Run a check in a forked child, for what must not outlive it: another user's identity
(a permission test as root), lowered resource limits, mounts of its own (a directory made
read-only under a running job)."""

from __future__ import annotations

import ctypes
import os
import sys
import traceback
from collections.abc import Callable

import pytest

NOBODY = 65534  # the unprivileged user and group


def as_nobody() -> None:
    """Become the unprivileged user (in a child: the test process stays root)."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _fork() -> int:
    """os.fork(), refused while this process has a process group: the child inherits the
    group without the gloo threads behind it, and a group it makes or frees then waits on
    them for ever (the suite saw a child hang in ProcessGroupGloo's destructor). A child
    works without a group."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        raise RuntimeError("a child forked with a process group: shut it down first "
                           "(the child may start its own)")
    return os.fork()


def error_line_in_child(check: Callable[[], object],
                        errors: tuple[type[BaseException], ...]) -> str:
    """`check()` in a forked child: the line of the error of `errors` it raised, or ''
    when it raised none. Any other exception fails the test (the child exits 3)."""
    read, write = os.pipe()
    child = _fork()
    if child == 0:
        code = 3
        try:
            os.close(read)
            try:
                check()
                code = 0
            except errors as exc:
                os.write(write, str(exc).encode())
                code = 0
        finally:
            os._exit(code)
    os.close(write)
    message = os.read(read, 4096).decode()
    os.close(read)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, message
    return message


def outcome_in_child(check: Callable[[], str]) -> str:
    """`check()` in a forked child: the string it returns. An exception in the child fails
    the test with the child's traceback; `SkipInChild(reason)` skips it."""
    read, write = os.pipe()
    child = _fork()
    if child == 0:
        try:
            os.close(read)
            try:
                outcome = "ok:" + check()
            except SkipInChild as exc:
                outcome = f"skip:{exc}"
            except BaseException:
                outcome = "error:" + traceback.format_exc()
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    kind, _, text = b"".join(chunks).decode().partition(":")
    if kind == "skip":
        pytest.skip(text)
    assert kind == "ok", text or "the child ended without an outcome"
    return text


class SkipInChild(Exception):
    """Raised in a child when what the test needs is not allowed here (its reason)."""


_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def private_mounts() -> None:
    """In a child: a mount namespace of its own, so that what it mounts is seen by nobody
    else and goes away with it (needs root; SkipInChild where it is not allowed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise SkipInChild(f"a private mount namespace is not allowed here "
                          f"({os.strerror(ctypes.get_errno())})")
    _mount(None, "/", _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host


def make_read_only(directory: str) -> None:
    """In a child after private_mounts(): `directory` becomes a read-only mount of itself
    (what a file system remounted read-only under a running job looks like to new
    operations; descriptors opened before keep their mount)."""
    _mount(directory, directory, _MS_BIND)
    _mount(None, directory, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)


def _mount(source: str | None, target: str, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source and source.encode(), target.encode(), None, flags, None) != 0:
        raise SkipInChild(f"mount of {target} is not allowed here "
                          f"({os.strerror(ctypes.get_errno())})")
