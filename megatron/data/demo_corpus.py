"""The built-in demo corpus: training data made offline from text already on the machine.

The docstrings of Python's standard library (read with `ast` from the source files, never
imported) become a JSONL corpus, a byte-level BPE tokenizer is trained on it, and the corpus
is preprocessed into a Megatron indexed dataset. The result is built once per cache
directory and reused; several processes (torchrun ranks) may ask for it at the same time:
one builds under a file lock, into a temporary directory renamed into place when complete,
and the others wait and reuse it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron.common.files import leftover_temporaries, staged_paths
from megatron.common.progress import Progress
from megatron.data.cache import default_cache_dir, file_lock
from megatron.data.indexed_dataset_writer import Log, write_indexed_dataset
from megatron.data.jsonl import iter_jsonl_texts
from megatron.data.tokenizer import train_bpe_tokenizer

# Bump when the corpus recipe changes, so that old caches are not reused.
_FORMAT_VERSION = 1
# Shorter docstrings are mostly one-line summaries ("Return self.") that add little text.
_MIN_DOCSTRING_CHARS = 40
# Directories of the standard library that hold tests, fixtures or third-party code.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_CORPUS_FILE = "corpus.jsonl"
_TOKENIZER_FILE = "tokenizer.json"
_DATA_NAME = "text_document"


@dataclass(frozen=True)
class DemoCorpus:
    data_prefix: str  # Megatron indexed dataset: data_prefix.bin / data_prefix.idx
    tokenizer_path: str  # tokenizer JSON, for load_tokenizer
    corpus_path: str  # the source text, one {"text": ...} per line


def ensure_demo_corpus(
    cache_dir: str | None = None,
    vocab_size: int = 4096,
    log: Log = print,
    source_root: str | None = None,
) -> DemoCorpus:
    """Return the demo corpus, building it first if this cache does not hold it yet.

    `source_root` (default: the standard library of this Python) is the directory whose
    .py files give the docstrings. Deterministic: the same files give the same tokens.
    """
    root = os.path.realpath(source_root or sysconfig.get_paths()["stdlib"])
    cache = os.path.abspath(cache_dir or default_cache_dir())
    name = f"demo-corpus-{_cache_key(root, vocab_size)}"
    final_dir = os.path.join(cache, name)
    corpus = _corpus_in(final_dir)
    if os.path.isdir(final_dir):
        return corpus
    # file_lock creates the cache directory (one line when it cannot)
    with file_lock(os.path.join(cache, name + ".lock"), cache):
        if os.path.isdir(final_dir):  # another process built it while we waited
            return corpus
        # Leftovers of a killed build: safe to remove, no one else builds while we hold the lock.
        for stale in leftover_temporaries(final_dir):
            shutil.rmtree(stale, ignore_errors=True)
        with staged_paths(final_dir, directories=True) as (tmp_dir,):
            _build(root, vocab_size, tmp_dir, log)
    log(f"demo corpus ready: {final_dir}")
    return corpus


def _corpus_in(directory: str) -> DemoCorpus:
    return DemoCorpus(
        data_prefix=os.path.join(directory, _DATA_NAME),
        tokenizer_path=os.path.join(directory, _TOKENIZER_FILE),
        corpus_path=os.path.join(directory, _CORPUS_FILE),
    )


def _cache_key(source_root: str, vocab_size: int) -> str:
    # The Python version stands for the content of its standard library.
    identity = f"{_FORMAT_VERSION}|{vocab_size}|{source_root}|{sys.version}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _build(source_root: str, vocab_size: int, out_dir: str, log: Log) -> None:
    start = time.monotonic()
    files = _source_files(source_root)
    log(f"demo corpus: building once in {out_dir} from docstrings of {len(files)} files "
        f"under {source_root}")
    corpus = _corpus_in(out_dir)
    documents = 0
    with open(corpus.corpus_path, "w", encoding="utf-8") as f:
        for text in _unique_docstrings(files):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents += 1
    size_mb = os.path.getsize(corpus.corpus_path) / 1e6
    log(f"demo corpus: {documents} documents ({size_mb:.1f} MB of JSONL); "
        f"training a {vocab_size}-token BPE tokenizer")
    tokenizer = train_bpe_tokenizer(
        iter_jsonl_texts(corpus.corpus_path), vocab_size, corpus.tokenizer_path
    )
    log("demo corpus: tokenizing into a Megatron indexed dataset")
    stats = write_indexed_dataset(
        iter_jsonl_texts(corpus.corpus_path), tokenizer, corpus.data_prefix, log
    )
    log(f"demo corpus: {stats.documents} documents, {stats.tokens} tokens, "
        f"built in {time.monotonic() - start:.1f} s")


def _source_files(source_root: str) -> list[Path]:
    root = Path(source_root)
    if not root.is_dir():
        raise FileNotFoundError(f"demo corpus source '{source_root}': not a directory")
    files = [
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    # Sorted by relative path: the corpus order (and so the tokens) must not depend on the
    # order the file system lists directories in.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _unique_docstrings(files: list[Path]) -> Iterator[str]:
    seen: set[str] = set()
    with Progress("demo corpus: reading", total=len(files), unit="files") as progress:
        for path in files:
            for text in _docstrings(path):
                if text not in seen:
                    seen.add(text)
                    yield text
            progress.advance()


def _docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one source file, in a fixed (ast.walk) order."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old sources
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return  # e.g. Python 2 fixtures shipped with lib2to3
    for node in _statement_walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and len(text) >= _MIN_DOCSTRING_CHARS:
                yield text


# Nodes whose children may hold statements. A def or class is always a statement, and every
# ancestor of a statement is one of these, so walking only them breadth-first visits the
# defs in ast.walk's order (every kept node keeps its depth) without visiting expressions.
_STATEMENT_HOLDERS = (ast.mod, ast.stmt, ast.excepthandler, ast.match_case)


def _statement_walk(tree: ast.AST) -> Iterator[ast.AST]:
    """ast.walk restricted to the nodes that are or contain statements."""
    queue = deque([tree])
    while queue:
        node = queue.popleft()
        queue.extend(child for child in ast.iter_child_nodes(node)
                     if isinstance(child, _STATEMENT_HOLDERS))
        yield node
