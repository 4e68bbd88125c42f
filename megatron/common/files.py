"""Writing output files so that an error or a kill never leaves a half-written one.

Everything is written under a temporary name in the target's own folder (the same file
system, so the final rename is atomic) and renamed onto the target only when complete; on an
error the temporaries are removed. A kill can leave a temporary behind, never a half-written
target; leftover_temporaries() finds such leftovers for whoever may safely remove them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

# Temporaries are hidden files named .tmp-<random><target name>; an owned one is named
# .tmp-<pid>@<host>~<random><target name>, so that a later writer can tell a dead one's.
_PREFIX = ".tmp-"
_OWNED = re.compile(r"\.tmp-(\d+)@([^~/]*)~")


def missing_file(path: str) -> str:
    """Why `path` is not a readable file, for an error line: a directory given for a file
    is named as one (not "not found", which sends the user looking for a typo)."""
    if os.path.isdir(path):
        return "a directory, not a file"
    return "a broken symbolic link" if os.path.islink(path) else "file not found"


def make_parent_dir(path: str) -> None:
    """Create the directory `path` will be written into (an output checked writable at the
    start, its directory created only when something is written)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call write(stream) on a temporary file in the target folder, then rename it."""
    with staged_paths(path) as (temporary,):
        with open(temporary, "wb") as stream:
            write(stream)


@contextlib.contextmanager
def staged_paths(*targets: str, directories: bool = False,
                 owned: bool = False) -> Iterator[tuple[str, ...]]:
    """Yield one new, empty temporary file (or directory) per target, beside that target.

    For writers that open their outputs by path rather than take a stream: the body fills the
    temporaries; when it returns they are renamed onto the targets in the order given (so the
    last target appearing means all are complete), and if anything raises, the temporaries
    still present are removed. Their permissions follow the umask, as if made with open() or
    os.makedirs(). `owned` puts this process's id and host in their names, for
    remove_dead_temporaries.
    """
    prefix = f"{_PREFIX}{os.getpid()}@{socket.gethostname()}~" if owned else _PREFIX
    temporaries: list[str] = []
    try:
        for target in targets:
            folder = os.path.dirname(os.path.abspath(target))
            name = os.path.basename(target)
            if directories:
                temporaries.append(tempfile.mkdtemp(dir=folder, prefix=prefix, suffix=name))
                mode = 0o777
            else:
                handle, temporary = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=name)
                os.close(handle)
                temporaries.append(temporary)
                mode = 0o666
            os.chmod(temporaries[-1], mode & ~_current_umask())  # mkstemp/mkdtemp: private
        yield tuple(temporaries)
        for temporary, target in zip(temporaries, targets):
            os.replace(temporary, target)
    except BaseException:
        for temporary in temporaries:  # those already renamed are gone: nothing to remove
            if directories:
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)
        raise


def leftover_temporaries(target: str) -> list[str]:
    """Temporaries of `target` that a killed writer left behind (only safe to remove while no
    one else can be writing `target`, e.g. under a lock)."""
    folder = os.path.dirname(os.path.abspath(target))
    pattern = glob.escape(folder + os.sep) + _PREFIX + "*" + glob.escape(os.path.basename(target))
    return sorted(glob.glob(pattern))


def remove_dead_temporaries(target: str) -> list[str]:
    """Remove the owned temporaries of `target` whose writer, a process of this host, is
    dead (killed before it could clean up); returns their paths. A live writer's, and any
    whose owner cannot be told, are left alone."""
    host, removed = socket.gethostname(), []
    for path in leftover_temporaries(target):
        found = _OWNED.match(os.path.basename(path))
        if found is None or found.group(2) != host or _alive(int(found.group(1))):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
