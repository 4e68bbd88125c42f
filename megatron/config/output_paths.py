"""Output paths a command will write, checked before it starts: a writable directory (or
one that can be created), a file path that is not a directory. Each failure is ConfigError,
one line naming the flag. Light (the standard library): the tools that only simulate or
measure check their outputs with it without importing the training stack.
"""

from __future__ import annotations

import errno
import os

from megatron.config.errors import ConfigError


def check_writable_dir(flag: str, path: str) -> None:
    """`path` is a writable directory, or can be created as one: proven by a probe file in
    it or in its nearest existing ancestor, removed at once. Nothing is created: a run that
    stops on a later check leaves no empty directory (the writers create it when they
    first write). A symbolic link on the way that leads nowhere (a missing target, a loop)
    is named: makedirs would fail on it at the first save."""
    broken = broken_link_on(path)
    if broken is not None:
        link, reason = broken
        where = "" if link == os.path.abspath(path) else f" ({link})"
        raise ConfigError(flag, path, f"expected a writable directory; it is a symbolic "
                                      f"link{where} {reason}")
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(flag, path, f"expected a writable directory ({existing} is a file)")
    probe = os.path.join(existing, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(flag, path, f"expected a writable directory ({exc.strerror})") from None


def check_writable_file(flag: str, path: str) -> None:
    """`path` can be created or appended to: not a directory, its directory writable."""
    if os.path.isdir(path):
        raise ConfigError(flag, path, "expected a file path, found a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(flag, path, "expected a writable file (permission denied)")
    try:
        check_writable_dir(flag, os.path.dirname(os.path.abspath(path)))
    except ConfigError as exc:
        raise ConfigError(flag, path, f"its directory is not writable ({exc.expected})") from None


def broken_link_on(path: str) -> tuple[str, str] | None:
    """(the link, why it leads nowhere) for the first symbolic link of `path` or one of its
    ancestors that resolves to nothing; None when there is none."""
    path = os.path.abspath(path)
    chain = []
    while True:
        chain.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for candidate in reversed(chain):  # the outermost first
        if os.path.lexists(candidate) and not os.path.exists(candidate):
            try:
                os.stat(candidate)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return candidate, "that loops"
                return candidate, f"to {os.readlink(candidate)}, which does not exist"
    return None


def nearest_existing(path: str) -> str:
    """`path` itself when it exists, else its nearest ancestor that does."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
