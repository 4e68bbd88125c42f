"""The planner's worker processes are gone after success, after an error in a worker, and
when their parent is killed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.common.workers import worker_pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


def children() -> set[int]:
    """Live (not zombie) processes whose parent is this one."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(pid))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_results_in_order_and_no_worker_left():
    before = children()
    with worker_pool(2) as run_all:
        assert run_all(square, range(7)) == [x * x for x in range(7)]
        assert len(children() - before) == 2
    assert children() <= before


def test_an_error_in_a_worker_reaches_the_caller_and_no_worker_is_left():
    before = children()
    with pytest.raises(ValueError, match="three"), worker_pool(2) as run_all:
        run_all(fail_on_three, range(6))
    assert children() <= before


def test_one_worker_runs_in_this_process():
    before = children()
    with worker_pool(1) as run_all:
        assert run_all(square, [3]) == [9]
        assert children() == before


def test_workers_die_with_a_killed_parent():
    """A parent killed with SIGKILL (no shutdown runs) takes its workers with it."""
    script = ("import sys, time\n"
              f"sys.path.insert(0, {ROOT!r})\n"
              "from megatron.common.workers import worker_pool\n"
              "from tests.test_workers import pid_of\n"
              "with worker_pool(2) as run_all:\n"
              "    print(*run_all(pid_of, [0, 1]), flush=True)\n"
              "    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert workers and all(alive(p) for p in workers)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in workers)


def pid_of(_: int) -> int:
    time.sleep(0.2)  # both workers take a task
    return os.getpid()
