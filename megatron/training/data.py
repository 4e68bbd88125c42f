"""Old import paths kept working after data.py was split: the names training.py reads as
`data_mod.X` and the demo-corpus entry point docs/data.md shows, re-exported from the modules
that now hold them (data_checks, train_dataset, demo_corpus). New code imports from those."""

from megatron.training.data_checks import DataError, check_data_prefix
from megatron.training.demo_corpus import DemoCorpus, ensure_demo_corpus
from megatron.training.train_dataset import build_train_dataset, micro_batch_at

__all__ = [
    "DataError",
    "DemoCorpus",
    "build_train_dataset",
    "check_data_prefix",
    "ensure_demo_corpus",
    "micro_batch_at",
]
