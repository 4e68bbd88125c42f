"""The built-in demo corpus: content, build-once caching, concurrent callers, killed builds."""

import ast
import json
import multiprocessing
import os
import shutil
import signal
import sysconfig
import traceback
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.data.checks import check_data_prefix
from megatron.data.demo_corpus import ensure_demo_corpus
from megatron.data.tokenizer import load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py"]
BUILDING = "building once"


@pytest.fixture(scope="module")
def source_root(tmp_path_factory):
    """A few standard-library files, one in a test directory and one that does not parse."""
    root = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(STDLIB / name, root / name)
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text('"""A test module docstring that is Xskipped-marker."""\n')
    (root / "py2.py").write_text('"""Python 2 source, long enough to count, Xskipped-marker."""\nprint "x"\n')
    return str(root)


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_bytes()))


def test_corpus_is_the_docstrings_tokenized_and_cached(tmp_path, source_root):
    logs = []
    corpus = ensure_demo_corpus(str(tmp_path), vocab_size=400, log=logs.append,
                                source_root=source_root)
    assert sum(BUILDING in line for line in logs) == 1

    texts = [json.loads(line)["text"] for line in Path(corpus.corpus_path).read_text().splitlines()]
    assert module_docstring(STDLIB / "json/__init__.py") in texts
    assert module_docstring(STDLIB / "shlex.py") in texts
    assert module_docstring(STDLIB / "textwrap.py") not in texts  # a one-line summary: too short
    assert not any("Xskipped-marker" in t for t in texts)
    assert len(texts) == len(set(texts)) > 20

    tokenizer = load_tokenizer(corpus.tokenizer_path)
    assert tokenizer.vocab_size == 400
    check_data_prefix(corpus.data_prefix, tokenizer.vocab_size)
    documents = IndexedDataset(corpus.data_prefix)
    assert len(documents) == len(texts)
    for i in (0, len(texts) // 2, len(texts) - 1):
        ids = documents[i].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.detokenize(ids[:-1]) == texts[i]

    again = []
    assert ensure_demo_corpus(str(tmp_path), 400, again.append, source_root) == corpus
    assert again == []  # served from the cache, nothing rebuilt
    assert ensure_demo_corpus(str(tmp_path), 512, again.append, source_root) != corpus


def _call_in_child(cache_dir, source_root, barrier, results, kill_on):
    def log(line):
        results.put(("log", line))
        if kill_on and kill_on in line:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        if barrier is not None:
            barrier.wait()
        corpus = ensure_demo_corpus(cache_dir, 400, log, source_root)
        results.put(("done", corpus))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def _run_children(cache_dir, source_root, count, kill_on=None):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(count), ctx.Queue()
    procs = [ctx.Process(target=_call_in_child,
                         args=(cache_dir, source_root, barrier, results, kill_on))
             for _ in range(count)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while not results.empty():
        messages.append(results.get(timeout=5))
    return procs, messages


def test_concurrent_callers_build_once_and_get_the_same_corpus(tmp_path, source_root):
    procs, messages = _run_children(str(tmp_path), source_root, count=2)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [m for kind, m in messages if kind == "error"] == []
    done = [m for kind, m in messages if kind == "done"]
    assert len(done) == 2 and done[0] == done[1]
    assert sum(BUILDING in m for kind, m in messages if kind == "log") == 1
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_killed_build_leaves_no_corpus_and_the_next_call_rebuilds_it_identically(
    tmp_path, source_root
):
    killed_cache = tmp_path / "killed"
    procs, messages = _run_children(str(killed_cache), source_root, count=1,
                                    kill_on="tokenizing")
    assert procs[0].exitcode == -signal.SIGKILL
    leftovers = os.listdir(killed_cache)
    assert any(".tmp-" in p for p in leftovers)  # the half-built directory...
    assert not any(p.startswith("demo-corpus-") and "." not in p for p in leftovers)  # ...only

    corpus = ensure_demo_corpus(str(killed_cache), 400, lambda _: None, source_root)
    assert not any(".tmp-" in p for p in os.listdir(killed_cache))
    fresh = ensure_demo_corpus(str(tmp_path / "fresh"), 400, lambda _: None, source_root)
    for a, b in [(corpus.tokenizer_path, fresh.tokenizer_path),
                 (corpus.data_prefix + ".bin", fresh.data_prefix + ".bin"),
                 (corpus.data_prefix + ".idx", fresh.data_prefix + ".idx")]:
        assert Path(a).read_bytes() == Path(b).read_bytes(), a


def test_default_corpus_comes_from_the_standard_library(demo_cache):
    """What `make train` uses: the whole standard library, no download (the session's
    corpus: built by this session or, under tests/run_suite.py, by whichever of its two
    sessions took the corpus's lock first; tests/shared_corpus.py)."""
    again = []
    corpus = ensure_demo_corpus(demo_cache, log=again.append)
    assert again == []  # the build's result, served from the cache
    assert os.path.getsize(corpus.corpus_path) > 1_000_000
    texts = [json.loads(line)["text"] for line in Path(corpus.corpus_path).read_text().splitlines()]
    assert module_docstring(STDLIB / "json/__init__.py") in texts
    tokenizer = load_tokenizer(corpus.tokenizer_path)
    assert tokenizer.vocab_size == 4096
    check_data_prefix(corpus.data_prefix, tokenizer.vocab_size)
    assert len(IndexedDataset(corpus.data_prefix)) == len(texts)
    assert os.path.getsize(corpus.data_prefix + ".bin") // 2 > 300_000  # uint16 tokens
