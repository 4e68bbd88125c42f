"""The training loop, flags and data. Importing megatron.models first imports megatron-core
the way a host without CUDA needs it (see megatron/models/cpu_adaptation.py)."""

import megatron.models  # noqa: F401
