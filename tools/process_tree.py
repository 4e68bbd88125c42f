"""Run one command so that its end, or its time-out, ends every process it started.

    python tools/process_tree.py --timeout S --status FILE [--grace G] -- COMMAND ...

Killing a command's process group misses what it started in a session of its own (a
shared-memory reaper, a launcher's workers, a test's servers). So this process makes itself
the child subreaper of everything below it (Linux, PR_SET_CHILD_SUBREAPER): a process the
command started stays its descendant however it was started and whoever its parent was, and
/proc finds it. When the command exits, or after S seconds, its process group is killed;
what is left gets G seconds to end by itself (a reaper removes its owner's segments when the
owner is gone), then is killed. FILE gets one JSON object: the command's `returncode`
(null when killed), `timed_out`, and `left_running`: what had to be killed after the
command's own end or its group's kill (pid and command line each). SIGTERM (or the death of
the parent, which delivers one) ends everything the same way. Exit status 0 once FILE is
written (the command's status is in it), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.05


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived: end everything as on a time-out."""


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: only the process group is ended
        return False


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (zombies included), with its state letter, from /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
        except (OSError, IndexError):
            continue  # it ended meanwhile
        states[int(entry)] = fields[0]
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found[child] = states[child]
            todo.extend(children.get(child, []))
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _reap() -> None:
    """Collect the exit status of every adopted child that has ended."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _alive_below() -> list[int]:
    _reap()
    return [pid for pid, state in descendants(os.getpid()).items() if state != "Z"]


def end_the_rest(grace_s: float) -> list[dict]:
    """Wait up to `grace_s` for everything below this process to end by itself, then kill
    what is left (repeatedly: a process may start another while being killed)."""
    deadline = time.monotonic() + grace_s
    while _alive_below() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    killed: dict[int, str] = {}
    while alive := _alive_below():
        for pid in alive:
            killed.setdefault(pid, command_line(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(POLL_S)
    return [{"pid": pid, "command": line} for pid, line in killed.items()]


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted


def supervise(command: list[str], timeout_s: float, grace_s: float) -> dict:
    """Run `command` (in its own process group, output inherited) under this process's
    watch; the outcome as written to the status file."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    proc = subprocess.Popen(command, start_new_session=True)
    returncode, timed_out, interrupted = None, False, False
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    except Interrupted:
        interrupted = True
    if returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up below is not interrupted
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return {"returncode": returncode, "timed_out": timed_out, "interrupted": interrupted,
            "left_running": end_the_rest(grace_s)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(prog="process_tree.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, required=True, help="seconds the command may run")
    p.add_argument("--status", required=True, help="where the outcome (JSON) goes")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds what the command left gets to end by itself")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not command:
        p.error("no command after --; expected: -- COMMAND ...")
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the check that started us died: end it all
    outcome = supervise(command, args.timeout, args.grace)
    with open(args.status + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(args.status + ".tmp", args.status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
