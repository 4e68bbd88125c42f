"""The training samples: megatron.core's GPTDataset over an indexed dataset, and micro-batches
of it by index. The sample index is cached outside the data, built once under a file lock."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron.training.data_cache import default_cache_dir, file_lock
from megatron.training.data_checks import check_data_prefix
from megatron.training.tokenizer import HFTokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def build_train_dataset(
    data_prefix: str,
    tokenizer: HFTokenizer,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_dir: str | None = None,
) -> GPTDataset:
    """megatron.core's GPTDataset over `data_prefix` with at least `num_samples` samples of
    `seq_length` tokens; items are dicts of tokens, labels (int64), loss_mask (float) and
    position_ids, each of shape [seq_length].

    The shuffle/sample index is cached under `cache_dir` (default: default_cache_dir()),
    never next to the data. Without torch.distributed any number of processes may call this
    at once (a file lock serializes the index build); with torch.distributed initialized it is
    a collective call like megatron's builder: every rank calls it, rank 0 builds, the others
    read after megatron's barrier.
    """
    check_data_prefix(data_prefix, tokenizer.vocab_size)
    index_dir = _index_cache_dir(data_prefix, cache_dir)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data_prefix], None),
        split="1,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the model builds its own causal mask
        path_to_cache=index_dir,
    )

    def build() -> GPTDataset:
        builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
        return builder.build()[0]

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_rank() != 0:
        return build()
    # Rank 0 (or every process without torch.distributed) builds under the lock; the other
    # ranks wait in megatron's barrier, so the lock never spans a collective they must join.
    with file_lock(index_dir + ".lock"):
        try:
            return build()
        except (ValueError, EOFError, OSError):
            # A killed earlier build can leave a truncated .npy behind: drop and rebuild.
            shutil.rmtree(index_dir, ignore_errors=True)
            return build()


def _index_cache_dir(data_prefix: str, cache_dir: str | None) -> str:
    root = cache_dir or default_cache_dir()
    key = hashlib.sha256(os.path.realpath(data_prefix).encode()).hexdigest()[:16]
    return os.path.join(root, "gpt-index", key)


def micro_batch_at(dataset: GPTDataset, micro_batch_size: int, index: int) -> dict[str, torch.Tensor]:
    """Micro-batch number `index`: samples [index*b, (index+1)*b) stacked to [b, s] tensors.

    A pure function of (dataset, b, index), so every process of a pipeline that asks for
    the same index gets the same micro-batch.
    """
    start = index * micro_batch_size
    if start < 0 or start + micro_batch_size > len(dataset):
        raise IndexError(
            f"micro-batch {index} of size {micro_batch_size} needs samples up to "
            f"{start + micro_batch_size}, the dataset has {len(dataset)}"
        )
    return _collate(dataset, start, micro_batch_size)


def batch_iterator(
    dataset: GPTDataset, micro_batch_size: int, start_sample: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive micro-batches from sample `start_sample` on (resume: pass the number of
    samples already consumed), until fewer than `micro_batch_size` samples remain."""
    start = start_sample
    while start + micro_batch_size <= len(dataset):
        yield _collate(dataset, start, micro_batch_size)
        start += micro_batch_size


def _collate(dataset: GPTDataset, start: int, count: int) -> dict[str, torch.Tensor]:
    samples = [dataset[i] for i in range(start, start + count)]
    return {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}
