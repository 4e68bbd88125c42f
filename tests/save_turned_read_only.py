"""One process that saves a checkpoint into DIR, turns DIR read-only (a read-only mount of
itself, in a mount namespace of its own) and saves again, holding --save's lock as a run
does; it prints the second save's line and checks that releasing the lock afterwards
neither raises nor keeps its descriptor. Its last line on stdout: `ok:LINE`, or
`skip:REASON` where this machine allows no mount namespace.

    python tests/save_turned_read_only.py DIR

tests/test_checkpoint_faults.py runs it as a fork of the test session's zygote
(tests/forked_ranks.py): a fresh process, not a fork of the test process, whose process
groups' threads a forked child would inherit without them (tests/in_child.py)."""

from __future__ import annotations

import fcntl
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.common.save_lock import LOCK_NAME, SaveLock  # noqa: E402
from megatron.training.checkpointing import CheckpointSaver, CheckpointWriteError  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from tests.in_child import SkipInChild, make_read_only, private_mounts  # noqa: E402
from tests.test_checkpointing import MODEL, owned  # noqa: E402


def open_files() -> set[str]:
    """The paths this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def main(save: str) -> str:
    lock_file = os.path.join(save, LOCK_NAME)
    try:
        private_mounts()
    except SkipInChild as exc:
        return f"skip:{exc}"
    initialize_distributed()  # the saver's group, as a run's
    lock = SaveLock(save)
    lock.acquire()
    saver = CheckpointSaver(save, MODEL, async_save=False, log=lambda *_: None)
    try:
        saver.save(1, owned(1), {"consumed_samples": 8})
        try:
            make_read_only(save)
        except SkipInChild as exc:
            return f"skip:{exc}"
        try:
            saver.save(2, owned(2), {"consumed_samples": 16})
            raise AssertionError("a save into a read-only directory succeeded")
        except CheckpointWriteError as exc:
            line = str(exc)
    finally:
        saver.close()
        lock.release()
        shutdown_distributed()
    assert lock_file not in open_files(), "the lock's descriptor leaked"
    assert os.path.exists(lock_file)  # read-only: it stays, unlocked
    probe = os.open(lock_file, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: a next job takes it over
    os.close(probe)
    return f"ok:{line}"


if __name__ == "__main__":
    print(main(sys.argv[1]), flush=True)
