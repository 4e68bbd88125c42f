"""Tokenizing documents into Megatron indexed datasets (PREFIX.bin/PREFIX.idx) with
megatron.core's IndexedDatasetBuilder, as Megatron-LM's tools/preprocess_data.py fills it
(byte for byte: one sequence per non-empty sentence, EOD on the last one when asked); the
files appear only when complete."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron.common.files import remove_dead_temporaries, staged_paths
from megatron.common.progress import Progress
from megatron.data.checks import DataError
from megatron.data.jsonl import Field
from megatron.data.tokenizer import TokenizerError

Log = Callable[[str], None]
# (line number, {json key: text or list of sentences})
Record = tuple[int, Mapping[str, Field]]
# Documents tokenized per call of the tokenizer's (multi-threaded) batch encoder.
_ENCODE_CHUNK = 1024


@dataclass
class PreprocessStats:
    """What a write wrote: counts, input size, time and the token dtype."""

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
    tokenizer,
    output_prefix: str,
    log: Log = print,
    append_eod: bool = True,
) -> PreprocessStats:
    """Tokenize `texts` (one document each, EOD appended unless append_eod is False) into
    output_prefix.bin/.idx."""
    records = ((n, {"text": text}) for n, text in enumerate(texts, start=1))
    return write_indexed_datasets(records, tokenizer, {"text": output_prefix}, log=log,
                                  append_eod=append_eod)


def write_indexed_datasets(
    records: Iterable[Record],
    tokenizer,
    output_prefixes: Mapping[str, str],
    log: Log = print,
    append_eod: bool = True,
    source: str = "input",
    log_interval: int | None = None,
) -> PreprocessStats:
    """One indexed dataset per json key (`output_prefixes[key]`), one document per record.

    A progress line every `log_interval` documents (default: a count redrawn in place on
    a terminal, nothing otherwise), and one at the end. The files appear
    only when complete: they are written under temporary names carrying this process's id
    and renamed at the end; on an error or interrupt they are removed, and the temporaries
    a killed earlier run left are removed first.
    """
    if append_eod and tokenizer.eod is None:
        raise DataError("the tokenizer has no end-of-document token to append")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    keys = list(output_prefixes)
    bins = [output_prefixes[k] + ".bin" for k in keys]
    idxs = [output_prefixes[k] + ".idx" for k in keys]
    for target in (*bins, *idxs):
        for path in remove_dead_temporaries(target):
            log(f"removed {path}, left by a run that was killed")
    docs = tokens = nbytes = 0
    start = time.monotonic()
    # Megatron's lines every `log_interval` documents when asked for; otherwise a count
    # redrawn in place on a terminal (nothing in a log file or CI)
    progress = Progress("processed", unit="documents", enabled=None if not log_interval
                        else False)
    # The builder opens its outputs by path, hence staged paths rather than atomic_write.
    # The .bin files are renamed first: once an .idx is there, so is its .bin.
    with staged_paths(*bins, *idxs, owned=True) as temporaries:
        builders = {k: IndexedDatasetBuilder(t, dtype=dtype)
                    for k, t in zip(keys, temporaries[:len(keys)])}
        try:
            for chunk in _chunks(records, _ENCODE_CHUNK):
                for key, builder in builders.items():
                    for ids, lengths in _encode(chunk, key, tokenizer, append_eod, source):
                        builder.add_document(numpy.asarray(ids, dtype=dtype), lengths)
                        tokens += len(ids)
                docs += len(chunk)
                nbytes += sum(len(t.encode("utf-8")) for _, fields in chunk
                              for value in fields.values() for t in _sentences(value))
                if log_interval and docs // log_interval > (docs - len(chunk)) // log_interval:
                    log(_progress_line(docs, nbytes, tokens, time.monotonic() - start))
                progress.update(docs)
            if docs == 0:
                raise DataError("no documents in the input (expected at least one)")
            progress.close()
            for builder, idx_tmp in zip(builders.values(), temporaries[len(keys):]):
                builder.finalize(idx_tmp)  # closes the .bin
        except BaseException:
            progress.close()
            for builder in builders.values():
                builder.data_file.close()
            raise
    seconds = time.monotonic() - start
    log(_progress_line(docs, nbytes, tokens, seconds))
    return PreprocessStats(docs, tokens, nbytes, seconds, numpy.dtype(dtype).name)


def _sentences(value: Field) -> list[str]:
    return value if isinstance(value, list) else [value]


def _encode(chunk: list[Record], key: str, tokenizer, append_eod: bool, source: str
            ) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, sequence lengths) of each record's `key`, as Megatron's Encoder.encode: empty
    sentences dropped, EOD counted in the last sequence, nothing appended to an empty one."""
    texts = [t for _, fields in chunk for t in _sentences(fields[key])]
    try:
        encoded = iter(tokenizer.tokenize_batch(texts))
    except TokenizerError:
        _raise_for_first_bad_line(chunk, key, tokenizer, source)
        raise
    for _, fields in chunk:
        ids: list[int] = []
        lengths: list[int] = []
        for _ in _sentences(fields[key]):
            sentence = list(next(encoded))
            if sentence:
                ids.extend(sentence)
                lengths.append(len(sentence))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        yield ids, lengths


def _raise_for_first_bad_line(chunk: list[Record], key: str, tokenizer, source: str) -> None:
    for line_number, fields in chunk:
        try:
            tokenizer.tokenize_batch(_sentences(fields[key]))
        except TokenizerError as err:
            raise DataError(f"'{source}' line {line_number}: {err}") from None


def _chunks(items: Iterable[Record], size: int) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
