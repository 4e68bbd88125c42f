"""tests/run_suite.py, which `make test` runs: both sessions at once (the one-process tier
and the `after_unit` modules; the other multi-process tests), each in its own temporary
directory with one demo corpus between them, the first session's report after the
other's, and the exit status of the first session that failed. Stand-in sessions (a few
lines of Python) play pytest."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import run_suite

pytestmark = pytest.mark.unit

# a stand-in pytest: says which session it is (its -m, shortened to "unit" for the first
# and "not unit" for the second), where it writes and where its demo corpus is, then exits
# with the status the test gives that session. The first waits for a sign that the other
# has started (in the directory their temporary directories share): run one after the
# other, it would give up and fail.
STAND_IN = """
import os, sys, time
args = sys.argv[1:]
tier = {{FIRST!r}: "unit", {SECOND!r}: "not unit"}[args[args.index("-m") + 1]]
basetemp = args[args.index("--basetemp") + 1]
sign = os.path.join(os.path.dirname(basetemp), "the other tier started")
if tier == "unit":
    deadline = time.monotonic() + 30
    while not os.path.exists(sign):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)
else:
    open(sign, "w").close()
    time.sleep(0.3)
print(f"{tier} session in {basetemp} corpus {os.environ['MEGATRON_TEST_CACHE']}", flush=True)
sys.exit({codes}[tier])
"""


def _stand_in(monkeypatch, codes: dict[str, int]) -> None:
    script = (STAND_IN.replace("{codes}", repr(codes)).replace("{FIRST!r}", repr(run_suite.FIRST))
              .replace("{SECOND!r}", repr(run_suite.SECOND)))
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, "-c", script])


def test_both_tiers_run_at_once_and_the_one_process_report_comes_last(monkeypatch, capfd):
    _stand_in(monkeypatch, {"unit": 0, "not unit": 0})
    assert run_suite.main([]) == 0
    out = capfd.readouterr().out
    rest, unit = out.index("not unit session in"), out.index("\nunit session in")
    assert rest < out.index("one-process tier and the after_unit modules") < unit  # streamed, then the report
    # each tier has its own temporary directory
    assert out.split("not unit session in ")[1].split()[0].endswith("rest")
    assert out.split("\nunit session in ")[1].split()[0].endswith("unit")
    # one demo corpus for both, beside their temporary directories
    corpora = {line.split(" corpus ")[1] for line in out.splitlines() if " corpus " in line}
    assert len(corpora) == 1 and corpora.pop().endswith("corpus")
    assert out.strip().splitlines()[-1].startswith("run_suite: both sessions in ")


@pytest.mark.parametrize("codes, want", [({"unit": 1, "not unit": 0}, 1),
                                         ({"unit": 0, "not unit": 2}, 2),
                                         ({"unit": 1, "not unit": 3}, 1)])
def test_a_failing_tier_fails_the_suite_with_its_status(monkeypatch, capfd, codes, want):
    _stand_in(monkeypatch, codes)
    assert run_suite.main([]) == want
    out = capfd.readouterr().out
    assert "not unit session in" in out and "\nunit session in" in out  # both ran to the end


def test_a_selection_runs_one_session_with_the_arguments(monkeypatch, capfd):
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, "-c",
                                              "import sys; print(sys.argv[1:]); sys.exit(4)"])
    assert run_suite.main(["tests/test_units.py", "-k", "x"]) == 4
    assert capfd.readouterr().out.strip() == "['tests/test_units.py', '-k', 'x']"


# the runner in its own interpreter, its sessions stand-ins that write their pid and sleep
DRIVER = """
import sys
sys.path.insert(0, {root!r})
from tests import run_suite
run_suite.PYTEST = [sys.executable, "-c", {sleeper!r}]
sys.exit(run_suite.main([]))
"""
SLEEPER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(os.path.join({pids!r}, f"child-{{child.pid}}"), "w"):
    pass
with open(os.path.join({pids!r}, str(os.getpid())), "w"):
    pass
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, its parent not yet told
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_sessions_end_when_the_runner_is_terminated_or_killed(tmp_path, how):
    pids = tmp_path / "pids"
    pids.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # its temporary directory in the test's: a runner killed outright cannot remove it
    runner = subprocess.Popen([sys.executable, "-c", DRIVER.format(
        root=root, sleeper=SLEEPER.format(pids=str(pids)))],
        env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 30
    while len(os.listdir(pids)) < 4:
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.02)
    runner.send_signal(how)
    runner.wait(timeout=30)
    sessions = [int(name) for name in os.listdir(pids) if not name.startswith("child-")]
    # what a session started: ended with it on SIGTERM (its process group); after a
    # SIGKILL, the session's own clean-up is its business (pytest's zygote dies with it)
    started = [int(name.split("-")[1]) for name in os.listdir(pids) if name.startswith("child-")]
    gone = sessions + (started if how == signal.SIGTERM else [])
    try:
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in gone) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in gone if _alive(pid)], "a process outlived its runner"
    finally:
        for pid in sessions + started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
