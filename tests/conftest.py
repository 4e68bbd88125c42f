"""Test tiers by marker: `unit` (one process, seconds), `multiproc` (launches processes or
builds the demo corpus: minutes), `cuda` (needs a GPU, skipped without one).

`pytest -m unit` is the fast loop; the full suite (`make test`) runs all three.
"""

import pytest
import torch

# Modules whose tests start processes (torchrun, multiprocessing, the CLI) or build the demo
# corpus; single tests elsewhere that do so carry @pytest.mark.multiproc themselves.
MULTIPROC_MODULES = {
    "test_pipeline_executor",
    "test_pretrain_cli",
    "test_param_store_procs",
    "test_data_demo_corpus",
    "test_preprocess",
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


def pytest_sessionfinish(session, exitstatus):
    from tests.forked_ranks import close_zygote

    close_zygote()
