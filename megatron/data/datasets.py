"""The samples: megatron.core's GPTDatasets (or a weighted blend of them) over indexed
datasets, split into train, validation and test, and micro-batches of them by index. The sample index is cached outside the data, built once under a file lock."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field as dc_field

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron.common.meminfo import available_host_memory
from megatron.common.units import format_bytes
from megatron.data.cache import default_cache_dir, file_lock
from megatron.data.checks import DataError, check_data_prefix
from megatron.data.tokenizer import HFTokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def build_train_dataset(
    data_prefix: str,
    tokenizer: HFTokenizer,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_dir: str | None = None,
) -> GPTDataset:
    """The training split alone of one indexed dataset (see build_datasets)."""
    return build_datasets(DataBlend([data_prefix]), tokenizer, seq_length, [num_samples, 0, 0],
                          seed, cache_dir)[0]


@dataclass(frozen=True)
class DataBlend:
    """What to sample from, in megatron-core's terms: one blend (prefixes, weights or None
    for weights by size) split into train/validation/test by `split` ("969,30,1"), or one
    blend per split (`per_split`, each None or (prefixes, weights))."""

    prefixes: list[str] = dc_field(default_factory=list)
    weights: list[float] | None = None
    split: str = "1,0,0"
    per_split: list[tuple[list[str], list[float] | None] | None] | None = None

    def all_prefixes(self) -> list[str]:
        if self.per_split is None:
            return list(self.prefixes)
        return [p for blend in self.per_split if blend is not None for p in blend[0]]


def build_datasets(
    blend: DataBlend,
    tokenizer: HFTokenizer,
    seq_length: int,
    sizes: list[int],
    seed: int,
    cache_dir: str | None = None,
) -> list:
    """megatron.core's train, validation and test datasets (GPTDataset, or BlendedDataset
    for a blend; None for a split with no share or no size) through
    BlendedMegatronDatasetBuilder, with at least sizes[i] samples of `seq_length` tokens each;
    items are dicts of tokens, labels (int64), loss_mask (float) and position_ids, each of
    shape [seq_length].

    The shuffle/sample index is cached under `cache_dir` (default: default_cache_dir()),
    never next to the data. Without torch.distributed any number of processes may call this
    at once (a file lock serializes the index build); with torch.distributed initialized it is
    a collective call like megatron's builder: every rank calls it, rank 0 builds, the others
    read after megatron's barrier.
    """
    for prefix in blend.all_prefixes():
        check_data_prefix(prefix, tokenizer.vocab_size)
    index_dir = _index_cache_dir("\n".join(blend.all_prefixes()), cache_dir)
    per_split = blend.per_split is not None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None if per_split else (blend.prefixes, blend.weights),
        blend_per_split=blend.per_split,
        split=None if per_split else blend.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the model builds its own causal mask
        path_to_cache=index_dir,
    )

    return _build_cached(SplitGPTDataset, sizes, config, index_dir, cache_dir)


def _build_cached(dataset_class: type, sizes: list[int], config: GPTDatasetConfig,
                  index_dir: str, cache_dir: str | None) -> list:
    """megatron-core's builder, its indices cached in `index_dir`. Collective under
    torch.distributed: rank 0 builds under a file lock, the others read after megatron's
    barrier (so the lock never spans a collective they must join)."""
    def build() -> list:
        return BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True,
                                             config).build()

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_rank() != 0:
        return build()
    with file_lock(index_dir + ".lock", cache_dir or default_cache_dir()):
        try:
            return build()
        except DataError:
            raise
        except (ValueError, EOFError, OSError):
            # A killed earlier build can leave a truncated .npy behind: drop and rebuild.
            shutil.rmtree(index_dir, ignore_errors=True)
            return build()


class SplitGPTDataset(GPTDataset):
    """GPTDataset that refuses, before building them, the indices it could never finish:
    megatron-core counts epochs until the split's tokens cover the samples asked of it,
    which never ends at zero tokens (a tiny corpus whose validation share holds no
    document), and builds indices of epochs x documents entries, which a global batch far
    too large for the corpus turns into more memory than the machine has."""

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        if self.num_samples:
            split = self.index_split.name
            if num_tokens_per_epoch == 0:
                raise DataError(
                    f"its {split} split has no tokens ({len(self.indices)} documents) but "
                    f"{self.num_samples} samples are needed: give --split a larger {split} "
                    "share" + (" or --eval-iters 0" if split != "train" else ""))
            self._refuse_indices_beyond_memory(num_tokens_per_epoch, split)
        return super()._get_num_epochs(num_tokens_per_epoch)

    def _refuse_indices_beyond_memory(self, num_tokens_per_epoch: int, split: str) -> None:
        requested = (self.num_samples * self.config.sequence_length
                     + self.config.add_extra_token_to_sequence)
        epochs = -(-requested // num_tokens_per_epoch)
        # the document index (int32 per document per epoch), the sample index (two ints per
        # sample) and the shuffle index (one per sample), at most 8 bytes each
        index_bytes = epochs * len(self.indices) * 4 + self.num_samples * 3 * 8
        free = available_host_memory()
        if free is not None and index_bytes > free // 2:
            raise DataError(
                f"its {split} split would need {self.num_samples} samples, {epochs} passes "
                f"over its {len(self.indices)} documents: an index of "
                f"{format_bytes(index_bytes)}, more than half the {format_bytes(free)} "
                "available; give a smaller --global-batch-size or --train-iters (or "
                "--eval-iters), or more data")


def build_mock_datasets(tokenizer, seq_length: int, sizes: list[int], seed: int,
                        cache_dir: str | None = None) -> list:
    """megatron-core's MockGPTDataset for train, validation and test (--mock-data): synthetic
    sequences over the tokenizer's vocabulary with its end of document, split evenly as
    megatron-core splits mock data. Its indices are cached under `cache_dir`
    (--data-cache-path, as Megatron does; default: default_cache_dir())."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    index_dir = os.path.join(cache_dir or default_cache_dir(), "gpt-index", "mock")
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=None,
                              blend_per_split=None, tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False,
                              path_to_cache=index_dir)
    return _build_cached(MockGPTDataset, sizes, config, index_dir, cache_dir)


def _index_cache_dir(data_prefixes: str, cache_dir: str | None) -> str:
    root = cache_dir or default_cache_dir()
    real = "\n".join(os.path.realpath(p) for p in data_prefixes.split("\n"))
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
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
