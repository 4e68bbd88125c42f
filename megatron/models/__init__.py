"""LLaMA-2 built from megatron-core pieces. megatron-core is imported here first, the way
a host without CUDA needs it (see cpu_adaptation.import_megatron_core)."""

from megatron.models.cpu_adaptation import import_megatron_core

import_megatron_core()
