#!/usr/bin/env python
"""Pretrain a LLaMA-2 model with all model states in host memory.

One process:    python pretrain_llama.py --model-preset tiny
A pipeline:     torchrun --nproc-per-node 2 pretrain_llama.py --model-preset tiny
See README.md for the flags that matter.
"""

import os
import sys
import warnings

from megatron.common.progress import say_starting

if os.environ.get("RANK", "0") == "0":  # the imports take seconds (more on a loaded node)
    say_starting("pretrain_llama.py: starting (importing torch and megatron-core)")

# megatron-core warns at import that apex / Transformer Engine are absent (optional GPU extras
# here) and about config defaults we do not use: noise on every run.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

try:
    from megatron.training.training import main  # noqa: E402
except ImportError as error:
    if "CPU_ADAM_" not in str(error):
        raise
    # a speed knob of the C++ optimizer set to a bad value in the environment: bad input
    print(f"pretrain_llama.py: error: {error}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    import os

    from megatron.common.launcher_watch import watch_launcher
    from megatron.config.launcher_env import launcher_rank

    watch_launcher(rank=launcher_rank())  # a bad RANK is refused by main()
    sys.exit(main())
