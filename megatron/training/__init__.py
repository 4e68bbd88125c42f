"""The training loop, flags and data. megatron-core is imported here first, the way a
host without CUDA needs it (see megatron/models/cpu_adaptation.py, import_megatron_core):
every module of this package reaches megatron-core after this."""

from megatron.models.cpu_adaptation import import_megatron_core

import_megatron_core()
