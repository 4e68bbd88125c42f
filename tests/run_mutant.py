"""Test harness: pretrain_llama.py with one stream wait of the runtime removed.

    MEGATRON_TEST_DROP_WAIT=path:line:col torchrun ... tests/run_mutant.py [pretrain_llama.py flags]

The site is one that tests/wait_mutants.py finds; without the variable nothing is removed.
tests/test_wait_mutants.py, which has found the sites already, passes the whole site
instead (SITE_ENV, its fields as JSON): each mutant run then skips a scan of every module
of the package (about a second of CPU, a run's own cost again).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

SITE_ENV = "MEGATRON_TEST_DROP_WAIT_SITE"

if __name__ == "__main__":  # imported by the test for SITE_ENV alone
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    from megatron.training.training import main
    from tests.wait_mutants import WaitSite, drop_wait, drop_wait_from_environment

    if os.environ.get(SITE_ENV):
        drop_wait(WaitSite(**json.loads(os.environ[SITE_ENV])))
    else:
        drop_wait_from_environment()
    sys.exit(main())
