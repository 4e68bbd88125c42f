"""tests/run_suite.py, which `make test` runs: both tiers at once, each in its own
temporary directory, the one-process tier's report after the other's, and the exit status
of the first tier that failed. Stand-in sessions (a few lines of Python) play pytest."""

import sys

import pytest

from tests import run_suite

pytestmark = pytest.mark.unit

# a stand-in pytest: says which tier it is and where it writes, then exits with the status
# the test gives that tier. The one-process tier waits for a sign that the other has
# started (in the directory their temporary directories share): run one after the other,
# it would give up and fail.
STAND_IN = """
import os, sys, time
args = sys.argv[1:]
tier = args[args.index("-m") + 1]
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
print(f"{tier} session in {basetemp}", flush=True)
sys.exit({codes}[tier])
"""


def _stand_in(monkeypatch, codes: dict[str, int]) -> None:
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, "-c",
                                              STAND_IN.replace("{codes}", repr(codes))])


def test_both_tiers_run_at_once_and_the_one_process_report_comes_last(monkeypatch, capfd):
    _stand_in(monkeypatch, {"unit": 0, "not unit": 0})
    assert run_suite.main([]) == 0
    out = capfd.readouterr().out
    rest, unit = out.index("not unit session in"), out.index("\nunit session in")
    assert rest < out.index("one-process tier (-m unit)") < unit  # streamed, then the report
    # each tier has its own temporary directory
    assert out.split("not unit session in ")[1].split()[0].endswith("rest")
    assert out.split("\nunit session in ")[1].split()[0].endswith("unit")
    assert out.strip().splitlines()[-1].startswith("run_suite: both tiers in ")


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
