"""Test harness: pretrain_llama.py with one stream wait of the runtime removed.

    MEGATRON_TEST_DROP_WAIT=path:line:col torchrun ... tests/run_mutant.py [pretrain_llama.py flags]

The site is one that tests/wait_mutants.py finds; without the variable nothing is removed.
The variable may also hold the site whole (`WaitSite.spec`, what tests/test_wait_mutants.py
passes): the run then need not scan the package to find it.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

from megatron.training.training import main  # noqa: E402
from tests.wait_mutants import drop_wait_from_environment  # noqa: E402

if __name__ == "__main__":
    drop_wait_from_environment()
    sys.exit(main())
