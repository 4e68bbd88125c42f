"""Test tiers by marker: `unit` (one process, seconds), `multiproc` (launches processes or
builds the demo corpus: minutes), `cuda` (needs a GPU, skipped without one).

`pytest -m unit` is the fast loop; the full suite (`make test`, tests/run_suite.py) runs
the `unit` tier in one session beside the others in another. In one session, the modules
with multi-process tests run after the others, so that the zygote their ranks are forked
from (tests/forked_ranks.py) and the demo corpus they train on (tests/shared_corpus.py)
get ready in the background meanwhile, on the core the one-process tests leave idle.
"""

import os
import shutil
import uuid

import pytest
import torch

from tests import forked_ranks, shared_corpus

# Modules whose tests start processes (torchrun, multiprocessing, the CLI) or build the demo
# corpus; single tests elsewhere that do so carry @pytest.mark.multiproc themselves.
MULTIPROC_MODULES = {
    "test_pipeline_executor",
    "test_pretrain_cli",
    "test_param_store_procs",
    "test_data_demo_corpus",
    "test_preprocess",
}
# Multi-process modules that `make test` runs in the one-process tier's session, after its
# tests (tests/run_suite.py): about 140 s of the other session's 500, so that the two end
# together. Chosen among those with no tight time limit of their own (not the Slurm job).
AFTER_UNIT_MODULES = {
    "test_doc_commands",
    "test_gpu_host_rehearsal",
    "test_megatron_compat",
    "test_wait_mutants",
    "test_data_parallel",
}


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            if not torch.cuda.is_available():
                item.add_marker(skip_cuda)
        elif item.module.__name__.rsplit(".", 1)[-1] in MULTIPROC_MODULES:
            item.add_marker(pytest.mark.multiproc)
        elif "multiproc" not in item.keywords:
            item.add_marker(pytest.mark.unit)
        if ("multiproc" in item.keywords
                and item.module.__name__.rsplit(".", 1)[-1] in AFTER_UNIT_MODULES):
            item.add_marker(pytest.mark.after_unit)
    # whole modules move (their module-scoped fixtures are set up once), order kept
    later = {item.module for item in items if "multiproc" in item.keywords}
    items.sort(key=lambda item: item.module in later)


def pytest_collection_finish(session):
    if any("multiproc" in item.keywords for item in session.items):
        forked_ranks.warm_up()
        shared_corpus.start()


def pytest_sessionfinish(session, exitstatus):
    forked_ranks.close_zygote()
    shared_corpus.stop()


@pytest.fixture(scope="session")
def demo_cache() -> str:
    """The cache directory holding the session's demo corpus (built)."""
    return shared_corpus.cache_dir()


@pytest.fixture
def private_shm_dir() -> str:
    """A directory of its own on /dev/shm's tmpfs, for tests of the sweep of dead
    processes' segments: in /dev/shm itself, any start in the suite's other session sweeps
    the segments a test has just left, before the test's own start can."""
    path = os.path.join("/dev/shm", f"sweep-test-{uuid.uuid4().hex}")  # not "mlm-": no sweep
    os.mkdir(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)
