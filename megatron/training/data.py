"""Training data: JSONL -> tokens -> Megatron indexed dataset (.bin/.idx) -> GPTDataset batches.

Everything goes through megatron.core.datasets: IndexedDatasetBuilder writes the files,
BlendedMegatronDatasetBuilder/GPTDataset turn them into fixed-length samples.
Files are written under temporary names and renamed at the end, and shared caches are
guarded by a file lock, so that concurrent processes and killed runs leave nothing
half-written behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron.common.files import staged_paths
from megatron.training.tokenizer import HFTokenizer

Log = Callable[[str], None]
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
# Documents tokenized per call of the tokenizer's (multi-threaded) batch encoder.
_ENCODE_CHUNK = 1024
_PROGRESS_EVERY_S = 2.0
# Token ids checked against the tokenizer's vocabulary (the first ones of the .bin).
_VOCAB_CHECK_TOKENS = 1 << 22
_DTYPE_CODES = {member.value for member in DType}


class DataError(ValueError):
    """Input data is missing, corrupt or does not fit: the message names the path and what
    was expected."""


def default_cache_dir() -> str:
    """$MEGATRON_SYSX_CACHE, else ~/.cache/megatron-sysx."""
    return os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-sysx"
    )


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) on `path`, released on exit or process death."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_writable_prefix(prefix: str) -> None:
    """Raise DataError unless files `prefix`.* can be created."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise DataError(f"'{prefix}': directory '{directory}' does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"'{prefix}': directory '{directory}' is not writable")


# ---------------------------------------------------------------------------------------------
# JSONL -> indexed dataset


def iter_jsonl_texts(path: str, json_key: str = "text") -> Iterator[str]:
    """The `json_key` string of each line of a JSONL file; blank lines are skipped.

    Raises DataError naming the file and line number for a line that is not a JSON object
    with a string under `json_key`.
    """
    if not os.path.isfile(path):
        raise DataError(f"'{path}': file not found (expected a JSONL file)")
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"'{path}' line {line_number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{where}: not valid UTF-8 (expected UTF-8 JSONL)") from None
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{where}: invalid JSON ({err.msg}); expected one JSON object per line"
                ) from None
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{where}: expected a JSON object with a string field '{json_key}'")
            yield text


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    dtype: str


def _progress_line(docs: int, nbytes: int, tokens: int, seconds: float) -> str:
    seconds = max(seconds, 1e-9)
    return (
        f"processed {docs} documents, {tokens} tokens "
        f"({docs / seconds:.0f} docs/s, {nbytes / seconds / 1e6:.2f} MB/s)"
    )


def write_indexed_dataset(
    texts: Iterable[str],
    tokenizer: HFTokenizer,
    output_prefix: str,
    log: Log = print,
) -> PreprocessStats:
    """Tokenize `texts` (one document each, EOD appended) into output_prefix.bin/.idx.

    The two files appear only when complete: they are written under temporary names and
    renamed at the end; on any error or interrupt the temporary files are removed.
    """
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    docs = tokens = nbytes = 0
    start = last_report = time.monotonic()
    # The builder opens its outputs by path, hence staged paths rather than atomic_write.
    # The .bin is renamed first: once the new .idx is there, so is its .bin.
    with staged_paths(output_prefix + ".bin", output_prefix + ".idx") as (bin_tmp, idx_tmp):
        builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)  # opens the temporary .bin
        try:
            for chunk in _chunks(texts, _ENCODE_CHUNK):
                for ids in tokenizer.tokenize_batch(chunk):
                    ids.append(tokenizer.eod)
                    builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                    tokens += len(ids)
                docs += len(chunk)
                nbytes += sum(len(t.encode("utf-8")) for t in chunk)
                now = time.monotonic()
                if now - last_report >= _PROGRESS_EVERY_S:
                    log(_progress_line(docs, nbytes, tokens, now - start))
                    last_report = now
            if docs == 0:
                raise DataError("no documents in the input (expected at least one)")
            builder.finalize(idx_tmp)  # closes the .bin
        except BaseException:
            builder.data_file.close()
            raise
    seconds = time.monotonic() - start
    log(_progress_line(docs, nbytes, tokens, seconds))
    return PreprocessStats(docs, tokens, nbytes, seconds, numpy.dtype(dtype).name)


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# The .idx layout (megatron.core.datasets.indexed_dataset): magic, version, dtype code,
# sequence count, document count, then int32 lengths, int64 pointers, int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")


def _check_index_layout(idx_path: str) -> None:
    """Validate the .idx header and size before megatron's reader sees the file (its reader
    fails on a corrupt file with bare asserts and a noisy destructor)."""
    with open(idx_path, "rb") as f:
        header = f.read(_IDX_HEADER.size)
    problem = None
    if len(header) < _IDX_HEADER.size:
        problem = f"{len(header)} bytes, shorter than the {_IDX_HEADER.size}-byte header"
    else:
        magic, version, dtype_code, sequences, documents = _IDX_HEADER.unpack(header)
        expected = _IDX_HEADER.size + sequences * (4 + 8) + documents * 8
        if magic != _IDX_MAGIC or version != 1:
            problem = "bad header (expected a version-1 MMIDIDX index)"
        elif dtype_code not in _DTYPE_CODES:
            problem = f"unknown token dtype code {dtype_code}"
        elif os.path.getsize(idx_path) != expected:
            problem = f"{os.path.getsize(idx_path)} bytes, expected {expected} from its header"
    if problem:
        raise DataError(f"'{idx_path}': not a readable Megatron index: {problem}")


def check_data_prefix(prefix: str, vocab_size: int | None = None) -> None:
    """Raise DataError unless prefix.bin/prefix.idx form a readable Megatron indexed dataset
    with at least one document (and, given `vocab_size`, token ids below it)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(
                f"'{path}': file not found (expected a Megatron indexed dataset "
                f"{prefix}.bin/.idx, made by tools/preprocess_data.py)"
            )
    _check_index_layout(idx_path)
    index = IndexedDataset(prefix, mmap=True).index
    lengths, pointers = index.sequence_lengths, index.sequence_pointers
    itemsize = numpy.dtype(index.dtype).itemsize
    expected_bin = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    n_documents = len(index.document_indices) - 1
    if n_documents < 1 or len(lengths) == 0:
        raise DataError(f"'{idx_path}': the dataset is empty (expected at least one document)")
    actual_bin = os.path.getsize(bin_path)
    if actual_bin != expected_bin:
        raise DataError(
            f"'{bin_path}': {actual_bin} bytes, expected {expected_bin} from its index "
            "(truncated or mismatched .bin/.idx)"
        )
    if vocab_size is not None:
        count = min(_VOCAB_CHECK_TOKENS, expected_bin // itemsize)
        head = numpy.fromfile(bin_path, dtype=index.dtype, count=count)
        if head.size and int(head.max()) >= vocab_size:
            raise DataError(
                f"'{bin_path}': token id {int(head.max())} does not fit the tokenizer's "
                f"vocabulary of {vocab_size} (was it made with another tokenizer?)"
            )


# ---------------------------------------------------------------------------------------------
# GPTDataset and micro-batches


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


def micro_batch_at(dataset: GPTDataset, micro_batch_size: int, index: int) -> dict:
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
) -> Iterator[dict]:
    """Consecutive micro-batches from sample `start_sample` on (resume: pass the number of
    samples already consumed), until fewer than `micro_batch_size` samples remain."""
    start = start_sample
    while start + micro_batch_size <= len(dataset):
        yield _collate(dataset, start, micro_batch_size)
        start += micro_batch_size


def _collate(dataset: GPTDataset, start: int, count: int) -> dict:
    samples = [dataset[i] for i in range(start, start + count)]
    return {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}


def __getattr__(name: str):
    # The demo corpus is built from this module's pieces; it is re-exported lazily here so
    # that `data.ensure_demo_corpus` works without a circular import.
    if name in ("ensure_demo_corpus", "DemoCorpus"):
        from megatron.training import demo_corpus

        return getattr(demo_corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
