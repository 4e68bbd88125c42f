"""Tokenizing documents into a Megatron indexed dataset (PREFIX.bin/PREFIX.idx) with
megatron.core's IndexedDatasetBuilder; the two files appear only when complete."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron.common.files import staged_paths
from megatron.data.checks import DataError
from megatron.data.tokenizer import HFTokenizer

Log = Callable[[str], None]
# Documents tokenized per call of the tokenizer's (multi-threaded) batch encoder.
_ENCODE_CHUNK = 1024
_PROGRESS_EVERY_S = 2.0


@dataclass
class PreprocessStats:
    """What write_indexed_dataset wrote: counts, input size, time and the token dtype."""

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
