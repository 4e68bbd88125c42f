"""`make test`: the whole suite as two pytest sessions at once. One runs the one-process
tier (`-m unit`) and then the multi-process modules marked `after_unit` (tests/conftest.py);
the other runs the rest of the multi-process tests. The multi-process tests leave part of
the machine idle (a rank waits on its peer, a launcher on its ranks), and the other session
fills it: on 2 cores the suite took 0.93 of one session's time (BENCHMARKS.md, "Two pytest
sessions at once"); the `after_unit` modules move about 140 s of the multi-process tests
into the first session, which ended first by about that much. The sessions share nothing a
test compares: each has its own temporary directory, the tests that look at /dev/shm look
at their own job's segments only (those of the sweep of dead processes' segments at a
directory of their own), a port a test chooses for a rank 0 stays reserved until that rank
binds it (megatron/common/ports.py), and the demo corpus they share is built once, under its
own file lock (MEGATRON_TEST_CACHE).

    python tests/run_suite.py              both sessions at once; the multi-process one
                                           streams, the first one's report follows it
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
FIRST, SECOND = "unit or after_unit", "not unit and not after_unit"  # the sessions' -m
CORPUS_ENV = "MEGATRON_TEST_CACHE"  # tests/shared_corpus.py builds the corpus there
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
    print(f"run_suite: both sessions in {time.monotonic() - started:.1f} s (-m '{FIRST}' "
          f"exit {codes[0]}, -m '{SECOND}' exit {codes[1]})", flush=True)
    return next((code for code in codes if code != 0), 0)


def _both_sessions() -> list[int]:
    """Both sessions' exit statuses, the first session's (the one-process tier's) first; its
    report printed after the other's."""
    with tempfile.TemporaryDirectory(prefix="pytest-tiers-") as tmp:
        first_log = os.path.join(tmp, "unit.log")
        env = {**os.environ, CORPUS_ENV: os.path.join(tmp, "corpus")}  # one demo corpus
        with open(first_log, "w") as log:
            procs: list[subprocess.Popen] = []
            # Ctrl-C and SIGTERM wait while the sessions start: one started but not yet in
            # `procs` could not be ended (its children would outlive it)
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                # the one-process tier first: its report is printed after the other's
                procs.append(subprocess.Popen(
                    [*PYTEST, "-m", FIRST, "-p", "no:cacheprovider",
                     "--basetemp", os.path.join(tmp, "unit")],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_end_with_this_process, env=env))
                procs.append(subprocess.Popen(
                    [*PYTEST, "-m", SECOND, "--basetemp", os.path.join(tmp, "rest")],
                    start_new_session=True, preexec_fn=_end_with_this_process, env=env))
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one pending: now
                codes = [proc.wait() for proc in reversed(procs)][::-1]
            except BaseException:
                _stop(procs)
                raise
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        print(f"\n===== the one-process tier and the after_unit modules (-m '{FIRST}'), "
              "run beside the above =====", flush=True)
        with open(first_log) as log:
            sys.stdout.write(log.read())
    return codes


def main(argv: list[str]) -> int:
    if argv:
        return subprocess.call([*PYTEST, *argv])
    return run_tiers()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
