"""`make test`: the whole suite as two pytest sessions at once, the one-process tier
(`-m unit`) beside the rest (the multi-process and CUDA tests). The multi-process tests
leave part of the machine idle (a rank waits on its peer, a launcher on its ranks), and
the one-process tests fill it: on 2 cores the suite took 0.93 of one session's time
(BENCHMARKS.md, "Two pytest sessions at once"). The tiers share nothing a test compares: each has its own temporary directory, and
the tests that look at /dev/shm look at their own job's segments only.

    python tests/run_suite.py              both tiers at once; the rest streams, the
                                           one-process tier's report follows it
    python tests/run_suite.py ARGS...      one pytest session with ARGS (a selection)

Exit status: 0 when both sessions passed, else the first failing one's (pytest's codes).
The sessions end with this process: on Ctrl-C and SIGTERM it ends them and what they
started, and the kernel ends them if it is killed outright.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfEs"]  # failures, errors, skips
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _end_with_this_process() -> None:
    """In each session, before it runs: SIGTERM when this process dies, SIGKILL included;
    and the signals this process holds back while it starts the sessions let through."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: Ctrl-C and SIGTERM still end them
        pass


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through run_tiers' clean-up, as Ctrl-C goes


def _stop(procs: list[subprocess.Popen]) -> None:
    """End both sessions and what they started (each leads its own process group)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_tiers() -> int:
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        codes = _both_sessions()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"run_suite: both tiers in {time.monotonic() - started:.1f} s (one-process tier "
          f"exit {codes[0]}, the rest exit {codes[1]})", flush=True)
    return next((code for code in codes if code != 0), 0)


def _both_sessions() -> list[int]:
    """Both sessions' exit statuses, the one-process tier's first; its report printed after
    the other's."""
    with tempfile.TemporaryDirectory(prefix="pytest-tiers-") as tmp:
        unit_log = os.path.join(tmp, "unit.log")
        with open(unit_log, "w") as log:
            procs: list[subprocess.Popen] = []
            # Ctrl-C and SIGTERM wait while the sessions start: one started but not yet in
            # `procs` could not be ended (its children would outlive it)
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                # the one-process tier: its report is printed after the other tier's
                procs.append(subprocess.Popen(
                    [*PYTEST, "-m", "unit", "-p", "no:cacheprovider",
                     "--basetemp", os.path.join(tmp, "unit")],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_end_with_this_process))
                procs.append(subprocess.Popen(
                    [*PYTEST, "-m", "not unit", "--basetemp", os.path.join(tmp, "rest")],
                    start_new_session=True, preexec_fn=_end_with_this_process))
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one pending: now
                codes = [proc.wait() for proc in reversed(procs)][::-1]
            except BaseException:
                _stop(procs)
                raise
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        print("\n===== the one-process tier (-m unit), run beside the above =====",
              flush=True)
        with open(unit_log) as log:
            sys.stdout.write(log.read())
    return codes


def main(argv: list[str]) -> int:
    if argv:
        return subprocess.call([*PYTEST, *argv])
    return run_tiers()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
