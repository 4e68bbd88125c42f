"""Mutation score of the stream sanitizer: every wait of the runtime (a stream's event or
stream wait, a host thread's wait for an event), removed one at a time, is caught by a
short run with the sanitizer on.

The waits are found in the source (tests/wait_mutants.py), so a wait added later is a new
mutant here. A mutant is tried on the configurations below in order (the one its function
names first) until one catches it: the optimizer subgroups' waits run only with
--optimizer-gpu-stride (streamed subgroups) or --optimizer-gpu-resident-fraction (resident).
Every wait is within one rank (the streams and threads of one process), so each run is one
process of the pipeline with all its stages: half the CPU of a 2-process run, and the same
waits on the same paths.
"""

import os

import pytest

from megatron.offload.device import SANITIZER_ENV
from tests import forked_ranks
from tests.test_pipeline_executor import MODEL
from tests.wait_mutants import DROP_ENV, find_waits

# Tiny shapes, one iteration without evaluation, one process running every stage (its
# parameter slots and gradient buffers are reused within the iteration). Subgroups of 4096
# elements: a few hundred, each group's split into several (both slots reused).
SHORT = ["--train-iters", "1", "--lr-warmup-iters", "0", "--eval-iters", "0",
         "--num-layers", "4", "--global-batch-size", "4",
         "--pipeline-schedule", "decoupled", "--cpu-optimizer-threads", "1"]
CONFIGS = {
    "default": [],
    "subgroups": ["--optimizer-gpu-stride", "2", "--optimizer-subgroup-size", "4096"],
    "resident": ["--optimizer-gpu-resident-fraction", "0.5",
                 "--optimizer-subgroup-size", "4096"],
}
# qualname word -> config first (_Launched: a device subgroup's flush, in either updater)
HINTS = {"Resident": "resident", "Subgroup": "subgroups", "_Launched": "subgroups"}
RACE = "stream race on "
CONCURRENT = 6  # runs at once


def _configs_for(site):
    first = [config for word, config in HINTS.items() if word in site.qualname][:1]
    return first + [c for c in CONFIGS if c not in first]


def _run(config, site=None):
    env = {"OMP_NUM_THREADS": "1", SANITIZER_ENV: "1"}
    if site is not None:  # the site whole: the run need not scan the package to find it
        env[DROP_ENV] = site.spec()
    args = [*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"], *SHORT,
            *CONFIGS[config]]
    return forked_ranks.start("tests/run_mutant.py", args, 1, env=env)


def _outcomes(runs):
    """Start the runs `CONCURRENT` at a time (one run's bubbles are another's compute);
    their CompletedProcess in order."""
    done = []
    for lo in range(0, len(runs), CONCURRENT):
        jobs = [_run(config, site) for config, site in runs[lo:lo + CONCURRENT]]
        done += [job.wait(180) for job in jobs]
    return done


@pytest.mark.multiproc
def test_the_sanitizer_catches_the_removal_of_every_wait(demo_cache):
    sites = find_waits()
    # the waits the runtime is known to need; more may come, fewer would mean a lost scan
    assert len(sites) >= 12, [str(s) for s in sites]
    # without a mutant every configuration runs clean under the sanitizer; each mutant
    # runs on the configurations meant for it first, then on the others until caught
    tries = {str(site): _configs_for(site) for site in sites}
    pending = [(config, None) for config in CONFIGS] + [(tries[str(s)][0], s) for s in sites]
    caught = {}
    while pending:
        retry = []
        for (config, site), run in zip(pending, _outcomes(pending)):
            if site is None:
                assert run.returncode == 0, (config, run.stderr[-3000:])
            elif run.returncode != 0:
                assert RACE in run.stderr, (str(site), config, run.stderr[-3000:])
                caught[str(site)] = config, run.stderr.split(RACE, 1)[1].split("\n", 1)[0]
            elif (left := tries[str(site)][tries[str(site)].index(config) + 1:]):
                retry.append((left[0], site))
        pending = retry
    missed = [f"{site} ({site.source})" for site in sites if str(site) not in caught]
    assert not missed, f"removed without the sanitizer noticing: {missed}"
    for site, (config, race) in caught.items():
        print(f"{site} [{config}]: {race}")
