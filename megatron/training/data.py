"""Old import path kept working after data.py was split: the names training.py reads as
`data_mod.X`, re-exported from the modules that now hold them (data_checks, train_dataset).
New code imports from those modules."""

from megatron.training.data_checks import DataError, check_data_prefix
from megatron.training.train_dataset import build_train_dataset, micro_batch_at

__all__ = ["DataError", "build_train_dataset", "check_data_prefix", "micro_batch_at"]
