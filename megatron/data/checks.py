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
# Sequences of the index checked per numpy pass (bounded memory on huge datasets).
_INDEX_CHECK_BLOCK = 1 << 22


class DataError(ValueError):
    """Input data is missing, corrupt or does not fit: the message names the path and what
    was expected."""


def check_writable_prefix(prefix: str) -> None:
    """Raise DataError unless files `prefix`.* can be created."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise DataError(f"'{prefix}': directory '{directory}' {what}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"'{prefix}': directory '{directory}' is not writable")


def _check_index_layout(idx_path: str) -> int:
    """Validate the .idx before megatron's reader sees it (its reader fails on a corrupt file
    with bare asserts, or reads garbage silently); returns the .bin size it implies.

    Checked, in this order: the header (magic, version, token dtype), the file size its
    sequence and document counts imply, lengths that are not negative, pointers that follow
    from the lengths, and document boundaries rising from 0 to the sequence count."""
    with open(idx_path, "rb") as f:
        header = f.read(_IDX_HEADER.size)
    size = os.path.getsize(idx_path)

    def corrupt(problem: str) -> DataError:
        return DataError(f"'{idx_path}': not a readable Megatron index: {problem}")

    if len(header) < _IDX_HEADER.size:
        raise corrupt(f"{len(header)} bytes, shorter than the {_IDX_HEADER.size}-byte header")
    magic, version, dtype_code, sequences, boundaries = _IDX_HEADER.unpack(header)
    if magic != _IDX_MAGIC:
        raise corrupt(f"the header does not start with Megatron's magic bytes {_IDX_MAGIC!r} "
                      f"(found {magic!r})")
    if version != 1:
        raise corrupt(f"the header's version is {version}, expected 1")
    if dtype_code not in _DTYPE_CODES:
        raise corrupt(f"the header's token dtype code is {dtype_code}, expected one of "
                      f"{sorted(_DTYPE_CODES)}")
    expected = _IDX_HEADER.size + sequences * (4 + 8) + boundaries * 8
    if size != expected:
        raise corrupt(f"{size} bytes, but its header's counts ({sequences} sequences, "
                      f"{boundaries} document boundaries) need {expected} bytes (truncated, "
                      "or the counts are corrupt)")
    itemsize = DType.size(dtype_code)
    lengths = numpy.memmap(idx_path, numpy.int32, "r", _IDX_HEADER.size, (sequences,)) \
        if sequences else numpy.zeros(0, numpy.int32)
    pointers = numpy.memmap(idx_path, numpy.int64, "r", _IDX_HEADER.size + 4 * sequences,
                            (sequences,)) if sequences else numpy.zeros(0, numpy.int64)
    position = 0  # where the next sequence must start in the .bin
    for first in range(0, sequences, _INDEX_CHECK_BLOCK):
        block = numpy.asarray(lengths[first:first + _INDEX_CHECK_BLOCK], numpy.int64)
        negative = numpy.flatnonzero(block < 0)
        if negative.size:
            i = first + int(negative[0])
            raise corrupt(f"sequence {i} has a negative length ({int(lengths[i])}); the "
                          "lengths are corrupt")
        ends = position + numpy.cumsum(block * itemsize)
        starts = numpy.concatenate(([position], ends[:-1]))
        wrong = numpy.flatnonzero(pointers[first:first + len(block)] != starts)
        if wrong.size:
            i = first + int(wrong[0])
            raise corrupt(f"sequence {i} starts at byte {int(pointers[i])} of the .bin, "
                          f"expected {int(starts[wrong[0]])} from the lengths before it; the "
                          "pointers are corrupt")
        position = int(ends[-1])
    if boundaries:
        documents = numpy.memmap(idx_path, numpy.int64, "r",
                                 _IDX_HEADER.size + 12 * sequences, (boundaries,))
        if documents[0] != 0 or documents[-1] != sequences or \
                bool(numpy.any(numpy.diff(documents) < 0)):
            raise corrupt(f"the document boundaries do not rise from 0 to the sequence count "
                          f"{sequences}; the document index is corrupt")
    else:
        raise corrupt("no document boundaries (expected at least the leading 0)")
    return position


def check_data_prefix(prefix: str, vocab_size: int | None = None) -> None:
    """Raise DataError unless prefix.bin/prefix.idx form a readable Megatron indexed dataset
    with at least one document (and, given `vocab_size`, token ids below it)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            stem, extension = os.path.splitext(prefix)
            if extension in (".bin", ".idx") and os.path.isfile(stem + ".idx"):
                # a file's name given for the prefix, as the first data of a new user often is
                raise DataError(f"'{path}': file not found; expected the prefix without "
                                f"{extension}: {stem}")
            raise DataError(
                f"'{path}': file not found (expected a Megatron indexed dataset "
                f"{prefix}.bin/.idx, made by tools/preprocess_data.py)"
            )
    expected_bin = _check_index_layout(idx_path)
    index = IndexedDataset(prefix, mmap=True).index
    lengths = index.sequence_lengths
    itemsize = numpy.dtype(index.dtype).itemsize
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
