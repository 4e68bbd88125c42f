"""The data a run trains on: tokenizers, indexed datasets and their blends and splits,
the built-in demo corpus, and the writer tools/preprocess_data.py uses. megatron-core is
imported here first, the way a host without CUDA needs it (see
megatron/models/cpu_adaptation.py, import_megatron_core)."""

from megatron.models.cpu_adaptation import import_megatron_core

import_megatron_core()
