"""tools/train_tokenizer.py and tools/preprocess_data.py: what they write, and bad input."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.data.indexed_dataset_writer import write_indexed_dataset
from megatron.data.tokenizer import load_tokenizer

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
    """The status the shell sees, not just main()'s return value."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"),
         "--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model", "t.json",
         "--output-prefix", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
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
