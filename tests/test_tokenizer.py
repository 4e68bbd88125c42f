"""The offline tokenizer: training, exact round trips, special tokens, bad files."""

import json

import pytest

from megatron.data.tokenizer import (
    EOD_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    TokenizerError,
    load_tokenizer,
    train_bpe_tokenizer,
)

TRAINING_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return a new list containing all items from the iterable in ascending order.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text, tabs\tand  double spaces, emoji 🎉 and CJK 漢字.",
] * 20


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(TRAINING_TEXTS, 320, str(path))
    return str(path)


def test_round_trip_is_exact_including_unseen_characters(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    samples = TRAINING_TEXTS[:4] + ["never seen: Ωμέγα ∮ ∀x∈ℝ 🚀\r\n\n  trailing  "]
    for text in samples:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(samples) == [tok.tokenize(t) for t in samples]


def test_bpe_merges_make_frequent_text_shorter_than_bytes(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    text = TRAINING_TEXTS[1]
    assert len(tok.tokenize(text)) < len(text.encode("utf-8")) / 2


def test_special_tokens_and_megatron_interface(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    vocab = tok.vocab
    assert tok.vocab_size == len(vocab) == 320
    assert tok.eod == vocab[EOD_TOKEN] and tok.pad == vocab[PAD_TOKEN]
    assert tok.eod != tok.pad and tok.eos == tok.eod
    # Special-token text inside a document is ordinary text, never an EOD.
    assert tok.eod not in tok.tokenize(f"before {EOD_TOKEN} after")
    assert tok.detokenize([tok.eod]) == EOD_TOKEN


def test_training_is_deterministic(tmp_path, tokenizer_path):
    again = tmp_path / "again.json"
    train_bpe_tokenizer(TRAINING_TEXTS, 320, str(again))
    with open(tokenizer_path, "rb") as first:
        assert again.read_bytes() == first.read()
    assert [p.name for p in tmp_path.iterdir()] == ["again.json"]  # no temporary left


def test_vocab_size_below_the_byte_alphabet_is_rejected(tmp_path):
    with pytest.raises(TokenizerError, match=f"at least {MIN_VOCAB_SIZE}"):
        train_bpe_tokenizer(TRAINING_TEXTS, 100, str(tmp_path / "t.json"))
    assert list(tmp_path.iterdir()) == []


def test_missing_and_corrupt_tokenizer_files_name_the_path(tmp_path, tokenizer_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TokenizerError, match="nope.json.*not found"):
        load_tokenizer(str(missing))

    truncated = tmp_path / "truncated.json"
    with open(tokenizer_path) as f:
        truncated.write_text(f.read()[:500])
    with pytest.raises(TokenizerError, match="truncated.json.*not a valid"):
        load_tokenizer(str(truncated))

    # A valid tokenizer without any end-of-document token cannot separate documents.
    with open(tokenizer_path) as f:
        spec = json.load(f)
    spec["added_tokens"] = []
    vocab = spec["model"]["vocab"]
    for name in (EOD_TOKEN, PAD_TOKEN):
        del vocab[name]
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="no_eod.json.*end-of-document"):
        load_tokenizer(str(no_eod))
