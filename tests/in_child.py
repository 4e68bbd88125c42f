"""Run a check in a forked child, for what must not outlive it: another user's identity
(a permission test as root), lowered resource limits."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534  # the unprivileged user and group


def as_nobody() -> None:
    """Become the unprivileged user (in a child: the test process stays root)."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def error_line_in_child(check: Callable[[], object],
                        errors: tuple[type[BaseException], ...]) -> str:
    """`check()` in a forked child: the line of the error of `errors` it raised, or ''
    when it raised none. Any other exception fails the test (the child exits 3)."""
    read, write = os.pipe()
    child = os.fork()
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
