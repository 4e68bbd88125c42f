"""tools/train_tokenizer.py and tools/preprocess_data.py: what they write, and bad input."""

import argparse
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers.text.utils.build_tokenizer import (
    build_tokenizer as build_megatron_tokenizer,
)

from megatron.common.files import remove_dead_temporaries, staged_paths
from megatron.data.checks import DataError, check_data_prefix
from megatron.data.indexed_dataset_writer import write_indexed_dataset
from megatron.data.tokenizer import load_tokenizer
from tests import forked_ranks
from tests.tokenizer_files import CORPUS, ReferenceGPT2, build_tokenizer_files

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    f"Document {i}: the {animal} jumps over the {thing}, {i * 7} times in a row."
    for i, (animal, thing) in enumerate(
        [("fox", "dog"), ("cat", "fence"), ("cow", "moon"), ("frog", "log")] * 15
    )
]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_data = load_tool("preprocess_data")
train_tokenizer = load_tool("train_tokenizer")


def write_jsonl(path: Path, texts, key="text") -> Path:
    path.write_text("".join(json.dumps({key: t, "url": "x"}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus and a tokenizer trained on it through the CLI."""
    root = tmp_path_factory.mktemp("corpus")
    jsonl = write_jsonl(root / "docs.jsonl", DOCUMENTS)
    tokenizer = root / "tokenizer.json"
    rc = train_tokenizer.main(
        ["--input", str(jsonl), "--vocab-size", "300", "--output", str(tokenizer)]
    )
    assert rc == 0
    return jsonl, tokenizer


def test_preprocess_writes_one_document_per_line_with_eod(tmp_path, corpus, capsys):
    jsonl, tokenizer_path = corpus
    prefix = tmp_path / "out"
    rc = preprocess_data.main(
        ["--input", str(jsonl), "--tokenizer-model", str(tokenizer_path),
         "--output-prefix", str(prefix), "--workers", "1"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "docs/s" in out and "MB/s" in out and f"{len(DOCUMENTS)} documents" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.idx"]

    tok = load_tokenizer(str(tokenizer_path))
    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == len(DOCUMENTS)
    for i, text in enumerate(DOCUMENTS):
        assert dataset[i].tolist() == tok.tokenize(text) + [tok.eod]
    assert str(dataset[0].dtype) == "uint16"


def test_bad_json_line_is_reported_with_its_number_and_nothing_is_written(
    tmp_path, corpus, capsys
):
    _, tokenizer_path = corpus
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, DOCUMENTS[:3])
    with open(bad, "a") as f:
        f.write('{"text": "unterminated\n')
    rc = preprocess_data.main(
        ["--input", str(bad), "--tokenizer-model", str(tokenizer_path),
         "--output-prefix", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("preprocess_data.py: error: --input ") and "line 4" in err
    assert len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


@pytest.mark.parametrize(
    "line, problem",
    [('{"body": "no text key"}', "string field 'text'"), ('["a list"]', "string field 'text'"),
     ('{"text": 3}', "string field 'text'")],
)
def test_lines_without_a_text_string_are_rejected(tmp_path, corpus, capsys, line, problem):
    _, tokenizer_path = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n' + line + "\n")
    rc = preprocess_data.main(
        ["--input", str(bad), "--tokenizer-model", str(tokenizer_path),
         "--output-prefix", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "line 3" in err and problem in err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_missing_inputs_and_unwritable_output_name_the_flag(tmp_path, corpus, capsys):
    jsonl, tokenizer_path = corpus
    a_file = tmp_path / "plain_file"
    a_file.write_text("x")
    cases = [
        (["--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model", str(tokenizer_path),
          "--output-prefix", str(tmp_path / "o")], "--input"),
        (["--input", str(jsonl), "--tokenizer-model", str(tmp_path / "missing.json"),
          "--output-prefix", str(tmp_path / "o")], "--tokenizer-model"),
        (["--input", str(jsonl), "--tokenizer-model", str(jsonl),  # not a tokenizer
          "--output-prefix", str(tmp_path / "o")], "--tokenizer-model"),
        (["--input", str(jsonl), "--tokenizer-model", str(tokenizer_path),
          "--output-prefix", str(a_file / "o")], "--output-prefix"),  # parent is a file
        (["--input", str(jsonl), "--tokenizer-model", str(tokenizer_path),
          "--output-prefix", str(tmp_path / "o"), "--workers", "0"], "--workers"),
    ]
    for argv, flag in cases:
        assert preprocess_data.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"preprocess_data.py: error: {flag} "), err
        assert len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["plain_file"]


def test_train_tokenizer_bad_input(tmp_path, corpus, capsys):
    jsonl, _ = corpus
    out = tmp_path / "tok.json"
    cases = [
        (["--input", str(tmp_path / "missing.txt"), "--vocab-size", "300",
          "--output", str(out)], "--input"),
        (["--input", str(jsonl), "--vocab-size", "200", "--output", str(out)], "--vocab-size"),
        (["--input", str(jsonl), "--vocab-size", "300",
          "--output", str(tmp_path / "no_dir" / "t.json")], "--output"),
    ]
    for argv, flag in cases:
        assert train_tokenizer.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"train_tokenizer.py: error: {flag} "), err
    assert list(tmp_path.iterdir()) == []


def test_plain_text_files_train_a_tokenizer(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(DOCUMENTS))
    out = tmp_path / "tok.json"
    assert train_tokenizer.main(["--input", str(text), "--vocab-size", "280",
                                 "--output", str(out)]) == 0
    tok = load_tokenizer(str(out))
    assert tok.detokenize(tok.tokenize(DOCUMENTS[5])) == DOCUMENTS[5]


def test_interrupt_while_writing_leaves_no_files(tmp_path, corpus):
    _, tokenizer_path = corpus
    tok = load_tokenizer(str(tokenizer_path))

    def texts_then_ctrl_c():
        yield from DOCUMENTS * 40  # more than one encoding chunk is written first
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_indexed_dataset(texts_then_ctrl_c(), tok, str(tmp_path / "out"), log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_cli_exit_status_in_a_real_process(tmp_path):
    """The status the shell sees, not just main()'s return value: `python
    tools/preprocess_data.py ...` in a process of its own, forked from the session's
    preloaded zygote (tests/forked_ranks.py: run as __main__, the interpreter's exit status;
    a fresh interpreter would spend seconds importing megatron.data first)."""
    proc = forked_ranks.launch(
        str(REPO / "tools" / "preprocess_data.py"),
        ["--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model", "t.json",
         "--output-prefix", str(tmp_path / "o")],
        timeout=120, cwd=str(tmp_path), env={"PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: --input {tmp_path / 'missing.jsonl'}: "
        "file not found (expected a JSONL file)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_empty_input_is_rejected_without_output(tmp_path, corpus, capsys):
    _, tokenizer_path = corpus
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    rc = preprocess_data.main(["--input", str(empty), "--tokenizer-model", str(tokenizer_path),
                               "--output-prefix", str(tmp_path / "out")])
    assert rc == 2 and "no documents" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["empty.jsonl"]


# --- Megatron's command line: byte-identical output, signals, corrupt files --------------

MEGATRON_DOCS = [
    {"text": t, "title": f"title {i}"} for i, t in enumerate(CORPUS)
] + [
    {"text": "", "title": "an empty text: an empty document, no EOD"},
    {"text": ["a list is ", "one sequence per sentence", ""], "title": "sentences"},
    {"text": "special-token text: <|endoftext|> </s> <s> stays as the tokenizer reads it",
     "title": "last"},
]
NULL_DOCS = [{"text": " ".join(str((i * 7 + j) % 50) for j in range(i % 9 + 1))}
             for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return build_tokenizer_files(str(tmp_path_factory.mktemp("tokenizer_files")))


def megatron_flags(kind, files):
    return {
        "HuggingFaceTokenizer": ["--tokenizer-model", files.hf_dir],
        "Llama2Tokenizer": ["--tokenizer-model", files.sp_model],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", files.sp_model],
        "GPT2BPETokenizer": ["--vocab-file", files.gpt2_vocab, "--merge-file", files.gpt2_merges],
        "NullTokenizer": ["--vocab-size", "50"],
    }[kind]


def megatron_tokenizer(kind, files):
    """The tokenizer Megatron-LM 0.16's preprocess_data.py builds (megatron.core's
    build_tokenizer); GPT2BPETokenizer: the published GPT-2 BPE (Megatron's own asks the hub);
    NullTokenizer: 0.19's (--vocab-size N: N ids, the end of document N-1), which is 0.16's
    built with N-1 (0.16: N ids plus the end of document N)."""
    if kind == "GPT2BPETokenizer":
        return ReferenceGPT2(files.gpt2_vocab, files.gpt2_merges)
    model = {"HuggingFaceTokenizer": files.hf_dir, "NullTokenizer": None}.get(kind, files.sp_model)
    args = argparse.Namespace(
        tokenizer_type=kind, tokenizer_model=model, vocab_file=None, merge_file=None,
        vocab_size=50 - 1 if kind == "NullTokenizer" else 50, tokenizer_special_tokens=None, tokenizer_sentencepiece_legacy=False,
        tokenizer_hf_use_fast=False, trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False, tokenizer_metadata=None)
    return build_megatron_tokenizer(args)


def megatron_preprocess(jsonl, prefix, keys, tokenizer, vocab_size, append_eod):
    """Megatron-LM 0.16's Encoder.encode and builders (one partition, no sentence split)."""
    dtype = DType.optimal_dtype(vocab_size)
    builders = {k: IndexedDatasetBuilder(f"{prefix}_{k}_document.bin", dtype=dtype)
                for k in keys}
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            data = json.loads(line)
            for key in keys:
                text = data[key]
                sentences = text if isinstance(text, list) else [text]
                doc_ids, sentence_lens = [], []
                for sentence in sentences:
                    sentence_ids = tokenizer.tokenize(sentence)
                    if len(sentence_ids) > 0:
                        doc_ids.extend(sentence_ids)
                        sentence_lens.append(len(sentence_ids))
                if len(doc_ids) > 0 and append_eod:
                    doc_ids.append(tokenizer.eod)
                    sentence_lens[-1] += 1
                builders[key].add_document(doc_ids, sentence_lens)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_document.idx")


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "Llama2Tokenizer",
                                  "GPTSentencePieceTokenizer", "GPT2BPETokenizer",
                                  "NullTokenizer"])
def test_megatron_flags_write_megatrons_files_byte_for_byte(tmp_path, tokenizer_files, kind,
                                                            capsys):
    docs = NULL_DOCS if kind == "NullTokenizer" else MEGATRON_DOCS
    keys = ["text"] if kind == "NullTokenizer" else ["text", "title"]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(d) + "\n" for d in docs))
    reference = megatron_tokenizer(kind, tokenizer_files)
    vocab_size = reference.vocab_size if kind != "GPT2BPETokenizer" else len(reference.encoder)
    for append_eod in (True, False):
        ours, theirs = tmp_path / f"ours{append_eod}", tmp_path / f"theirs{append_eod}"
        argv = ["--input", str(jsonl), "--output-prefix", str(ours), "--tokenizer-type", kind,
                *megatron_flags(kind, tokenizer_files), "--json-keys", *keys, "--workers", "2"]
        assert preprocess_data.main(argv + (["--append-eod"] if append_eod else [])) == 0, \
            capsys.readouterr().err
        megatron_preprocess(jsonl, theirs, keys, reference, vocab_size, append_eod)
        for key in keys:
            for ext in ("bin", "idx"):
                mine = Path(f"{ours}_{key}_document.{ext}").read_bytes()
                assert mine == Path(f"{theirs}_{key}_document.{ext}").read_bytes(), (key, ext)
    eod = reference.eod
    # (each dataset is kept while its memory map is read: its destructor unmaps it)
    with_eod = IndexedDataset(f"{tmp_path / 'oursTrue'}_text_document")
    without = IndexedDataset(f"{tmp_path / 'oursFalse'}_text_document")
    assert with_eod[0].tolist()[-1] == eod  # the EOD is there, and only with --append-eod
    assert with_eod[0].tolist()[:-1] == without[0].tolist() and eod not in without[0].tolist()


def test_split_sentences_is_refused_in_one_line(tmp_path, tokenizer_files, capsys):
    jsonl = write_jsonl(tmp_path / "in.jsonl", DOCUMENTS[:2])
    rc = preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "o"),
                               "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                               tokenizer_files.sp_model, "--split-sentences"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("preprocess_data.py: error: --split-sentences ")
    assert len(err.splitlines()) == 1 and "not supported" in err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_a_tokenizer_type_without_its_files_is_one_line_naming_the_flag(tmp_path,
                                                                         tokenizer_files, capsys):
    jsonl = write_jsonl(tmp_path / "in.jsonl", DOCUMENTS[:2])
    common = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "o")]
    cases = [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tokenizer_files.gpt2_vocab],
         "--merge-file missing"),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_files.gpt2_vocab],
         f"--tokenizer-model {tokenizer_files.gpt2_vocab}: not a SentencePiece model"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
         "--tokenizer-model gpt2: not a local path"),
        (["--tokenizer-type", "NullTokenizer"], "--vocab-size missing"),
    ]
    for extra, expected in cases:
        assert preprocess_data.main(common + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"preprocess_data.py: error: {expected}"), err
        assert len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_null_tokenizer_text_that_is_not_ids_names_the_line(tmp_path, capsys):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n{"text": "6 seven"}\n')
    rc = preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "o"),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "line 3" in err and "not token ids" in err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_raw_control_character_is_named_as_invalid_json_with_file_and_line(tmp_path, corpus,
                                                                         capsys):
    _, tokenizer_path = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "a raw\ttab"}\n')
    rc = preprocess_data.main(["--input", str(bad), "--tokenizer-model", str(tokenizer_path),
                               "--output-prefix", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"'{bad}' line 2: not valid JSON" in err
    assert "column 16: a raw control character" in err  # the tab, 1-based as editors count
    assert "character at)" not in err  # the parser's dangling phrase is reworded


def _slow_input(path: Path) -> Path:
    """A corpus big enough that preprocessing is still running when it is signalled (about
    6 MB; a kill comes within a chunk of 1,024 short documents)."""
    line = "".join(json.dumps({"text": " ".join(DOCUMENTS[i:i + 4])}) + "\n"
                   for i in range(0, len(DOCUMENTS), 4))
    path.write_text(line * 1500)
    return path


def _temporaries(out: Path, alive) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and alive():
        names = [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]
        if len(names) == 2:
            return names
        time.sleep(0.01)
    raise AssertionError("no temporary files appeared")


def test_sigterm_removes_the_temporary_files(tmp_path, corpus, capsys):
    _, tokenizer_path = corpus
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--input", str(_slow_input(tmp_path / "big.jsonl")), "--tokenizer-model",
            str(tokenizer_path), "--output-prefix", str(out / "big"), "--workers", "1"]
    seen = []
    running = threading.Event()
    running.set()

    def terminate_once_writing():
        seen.extend(_temporaries(out, running.is_set))
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` would

    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=terminate_once_writing)
    killer.start()
    try:
        rc = preprocess_data.main(argv)
    finally:
        running.clear()
        killer.join()
    assert len(seen) == 2 and rc == 128 + signal.SIGTERM
    assert "terminated" in capsys.readouterr().err and list(out.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the tool's handler is gone


def test_a_later_run_removes_what_a_killed_run_left(tmp_path, corpus, capsys):
    jsonl, tokenizer_path = corpus
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--input", str(_slow_input(tmp_path / "big.jsonl")), "--tokenizer-model",
            str(tokenizer_path), "--output-prefix", str(out / "big"), "--workers", "1"]
    pid = os.fork()
    if pid == 0:  # the run that will be killed with SIGKILL: no cleanup can run
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            preprocess_data.main(argv)
        finally:
            os._exit(0)
    try:
        left = _temporaries(out, lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert all(name.startswith(f".tmp-{pid}@") for name in left)
    assert sorted(p.name for p in out.iterdir()) == sorted(left)
    capsys.readouterr()
    rc = preprocess_data.main(["--input", str(jsonl), "--tokenizer-model", str(tokenizer_path),
                               "--output-prefix", str(out / "big"), "--workers", "1"])
    assert rc == 0
    assert capsys.readouterr().out.count("left by a run that was killed") == 2
    assert sorted(p.name for p in out.iterdir()) == ["big.bin", "big.idx"]


def test_a_live_writers_temporaries_are_left_alone(tmp_path):
    target = tmp_path / "x.bin"
    with staged_paths(str(target), owned=True) as (mine,):
        assert remove_dead_temporaries(str(target)) == []
        assert os.path.exists(mine)
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("offset, words", [
    (9, "the header's version is"),  # the version field
    (17, "token dtype code"),  # the dtype code
    (18, "header's counts"),  # the sequence count
    ("length", "negative length"),  # the last sequence's length, high byte
    ("pointer", "the pointers are corrupt"),  # the second sequence's pointer
])
def test_a_corrupt_index_is_named_in_words(tmp_path, corpus, offset, words):
    jsonl, tokenizer_path = corpus
    prefix = tmp_path / "ds"
    assert preprocess_data.main(["--input", str(jsonl), "--tokenizer-model",
                                 str(tokenizer_path), "--output-prefix", str(prefix)]) == 0
    idx = Path(f"{prefix}.idx")
    data = bytearray(idx.read_bytes())
    sequences = len(DOCUMENTS)
    position = {"length": 34 + 4 * sequences - 1, "pointer": 34 + 4 * sequences + 8}
    data[position.get(offset, offset)] ^= 0xDE
    idx.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        check_data_prefix(str(prefix))
    message = str(err.value)
    assert message.startswith(f"'{idx}': not a readable Megatron index: ") and words in message
    assert "expected -" not in message


def test_a_full_disk_while_writing_is_one_line_exit_1_and_leaves_no_files(tmp_path, corpus,
                                                                          capsys):
    import resource

    jsonl, tokenizer_path = corpus
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, previous[1]))  # writes past 256 B fail
    try:
        rc = preprocess_data.main(["--input", str(jsonl), "--tokenizer-model",
                                   str(tokenizer_path), "--output-prefix", str(tmp_path / "out"),
                                   "--workers", "1"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [f"preprocess_data.py: error: writing {tmp_path / 'out'}.bin/.idx failed "
                   "(File too large); no output written"]
    assert os.listdir(tmp_path) == []
