"""A Megatron user's path for each --tokenizer-type: tools/preprocess_data.py with Megatron's
flags, then pretrain_llama.py on PREFIX_text_document with the same tokenizer flags: the
loss is finite and the run's vocabulary is the tokenizer's."""

import json
import math
import os

import pytest
import sentencepiece
from transformers import AutoTokenizer

from tests import forked_ranks
from tests.test_preprocess import preprocess_data
from tests.tokenizer_files import CORPUS, build_tokenizer_files

pytestmark = pytest.mark.multiproc

TYPES = ["HuggingFaceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
         "GPT2BPETokenizer", "NullTokenizer"]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
         "--split", "1,0,0"]  # a tiny corpus: every document for training
NULL_VOCAB = 64


def tokenizer_flags(kind, files):
    return {
        "HuggingFaceTokenizer": ["--tokenizer-model", files.hf_dir],
        "Llama2Tokenizer": ["--tokenizer-model", files.sp_model],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", files.sp_model],
        "GPT2BPETokenizer": ["--vocab-file", files.gpt2_vocab, "--merge-file", files.gpt2_merges],
        "NullTokenizer": ["--vocab-size", str(NULL_VOCAB)],
    }[kind]


def expected_vocabulary(kind, files):
    """The tokenizer's own size, read with its library (NullTokenizer: Megatron-LM 0.19's
    N ids, the last the end of document)."""
    if kind == "HuggingFaceTokenizer":
        return len(AutoTokenizer.from_pretrained(files.hf_dir))
    if kind == "GPT2BPETokenizer":
        with open(files.gpt2_vocab) as f:
            return len(json.load(f))
    if kind == "NullTokenizer":
        return NULL_VOCAB
    return sentencepiece.SentencePieceProcessor(model_file=files.sp_model).get_piece_size()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every type preprocessed, then its training started (the runs go on side by side)."""
    root = tmp_path_factory.mktemp("typed")
    files = build_tokenizer_files(str(root))
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS * 3))
    null_jsonl = root / "ids.jsonl"
    null_jsonl.write_text("".join(
        json.dumps({"text": " ".join(str((i * 5 + j) % NULL_VOCAB) for j in range(30))}) + "\n"
        for i in range(40)))
    jobs = {}
    for kind in TYPES:
        prefix = root / kind
        source = null_jsonl if kind == "NullTokenizer" else jsonl
        rc = preprocess_data.main(["--input", str(source), "--output-prefix", str(prefix),
                                   "--tokenizer-type", kind, *tokenizer_flags(kind, files),
                                   "--append-eod", "--workers", "1"])
        assert rc == 0, kind
        metrics = root / f"{kind}.jsonl"
        jobs[kind] = (metrics, forked_ranks.start("pretrain_llama.py", [
            *MODEL, "--data-path", f"{prefix}_text_document", "--tokenizer-type", kind,
            *tokenizer_flags(kind, files), "--metrics-file", str(metrics),
            "--data-cache-dir", str(root / "cache")]))
    yield files, jobs
    for _, job in jobs.values():
        job.wait(timeout=300)


@pytest.mark.parametrize("kind", TYPES)
def test_pretrain_trains_on_megatron_preprocessed_data(runs, kind):
    files, jobs = runs
    metrics, job = jobs[kind]
    result = job.wait(timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    vocabulary = expected_vocabulary(kind, files)
    assert f"tokenizer: {kind} " in result.stdout
    assert f"vocabulary {vocabulary}," in result.stdout
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    assert [row["iteration"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows)
    # An untrained model's loss is near ln(vocabulary): the model has the tokenizer's size.
    assert abs(rows[0]["loss"] - math.log(vocabulary)) < 1.0, rows[0]["loss"]


def test_a_type_without_its_files_stops_pretrain_with_one_line(tmp_path, capsys):
    from megatron.training.training import main

    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"text": "1 2 3"}\n')
    assert preprocess_data.main(["--input", str(ids), "--output-prefix", str(tmp_path / "x"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "8"]) == 0
    before = sorted(os.listdir(tmp_path))
    missing = str(tmp_path / "none.model")
    with pytest.raises(SystemExit) as exc:
        main([*MODEL, "--data-path", str(tmp_path / "x_text_document"),
              "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", missing,
              "--data-cache-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"pretrain_llama.py: error: --tokenizer-model {missing}: no such file "
                       "(expected a SentencePiece .model file for Llama2Tokenizer)")
    assert sorted(os.listdir(tmp_path)) == before  # nothing written


def test_null_tokenizer_data_with_ids_beyond_vocab_size_is_refused(tmp_path, capsys):
    """NullTokenizer: the ids are the data's; a run with a smaller --vocab-size is told."""
    from megatron.training.training import main

    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"text": "1 2 90"}\n')
    assert preprocess_data.main(["--input", str(ids), "--output-prefix", str(tmp_path / "x"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == 0
    with pytest.raises(SystemExit) as exc:
        main([*MODEL, "--data-path", str(tmp_path / "x_text_document"),
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
              "--data-cache-dir", str(tmp_path)])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("pretrain_llama.py: error: --data-path ")
    assert "token id 90 does not fit the tokenizer's vocabulary of 50" in last
