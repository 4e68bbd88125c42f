"""Checks that data paths are usable before any work starts: an output prefix that can be
written, an indexed dataset megatron can read. DataError, whose message names the path and
what was expected, is the error for bad input data throughout the project."""

from __future__ import annotations

import os
import struct

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

# Token ids checked against the tokenizer's vocabulary (the first ones of the .bin).
_VOCAB_CHECK_TOKENS = 1 << 22
_DTYPE_CODES = {member.value for member in DType}
# The .idx layout (megatron.core.datasets.indexed_dataset): magic, version, dtype code,
# sequence count, document count, then int32 lengths, int64 pointers, int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")


class DataError(ValueError):
    """Input data is missing, corrupt or does not fit: the message names the path and what
    was expected."""


def check_writable_prefix(prefix: str) -> None:
    """Raise DataError unless files `prefix`.* can be created."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise DataError(f"'{prefix}': directory '{directory}' does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"'{prefix}': directory '{directory}' is not writable")


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
