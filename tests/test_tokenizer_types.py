"""Megatron's --tokenizer-type tokenizers: what each reports (vocabulary, end of document,
BOS) against the libraries read directly, and each wrong combination of flags."""

import json

import pytest
import sentencepiece
from transformers import AutoTokenizer

from megatron.data.tokenizer_types import (
    TokenizerFlagError,
    TokenizerSpec,
    build_typed_tokenizer,
)
from tests.tokenizer_files import CORPUS, ReferenceGPT2, build_tokenizer_files

UNSEEN = "never seen: Ωμέγα <|endoftext|> </s> 🚀\r\n\n  trailing  "


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return build_tokenizer_files(str(tmp_path_factory.mktemp("tokenizers")))


def test_huggingface_directory_has_the_tokenizers_vocabulary_and_eos_as_eod(files):
    tok = build_typed_tokenizer(TokenizerSpec("HuggingFaceTokenizer", files.hf_dir))
    hf = AutoTokenizer.from_pretrained(files.hf_dir)
    assert tok.vocab_size == len(hf) == 300
    assert tok.eod == hf.convert_tokens_to_ids("</s>") and tok.bos == hf.bos_token_id
    for text in (*CORPUS[:3], UNSEEN):
        # Megatron 0.16: no special tokens unless asked (the saved template would add <s>).
        assert tok.tokenize(text) == hf(text, add_special_tokens=False).input_ids
    with_special = build_typed_tokenizer(TokenizerSpec(
        "HuggingFaceTokenizer", files.hf_dir, tokenizer_hf_include_special_tokens=True))
    assert with_special.tokenize(CORPUS[0]) == [hf.bos_token_id, *tok.tokenize(CORPUS[0])]
    assert tok.detokenize(tok.tokenize(CORPUS[1])) == CORPUS[1]


def test_huggingface_tokenizer_json_file_loads_too(files):
    tok = build_typed_tokenizer(TokenizerSpec("HuggingFaceTokenizer",
                                              f"{files.hf_dir}/tokenizer.json"))
    assert tok.vocab_size == 300 and tok.eod == 2 and tok.pad == 0
    assert tok.to_json() is not None


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer"])
def test_sentencepiece_types_report_pieces_and_eos(files, kind):
    sp = sentencepiece.SentencePieceProcessor(model_file=files.sp_model)
    tok = build_typed_tokenizer(TokenizerSpec(kind, files.sp_model))
    assert tok.vocab_size == sp.get_piece_size() == 150
    assert tok.eod == sp.eos_id() and tok.bos == sp.bos_id()
    assert tok.tokenize_batch(CORPUS[:3]) == [sp.encode_as_ids(t) for t in CORPUS[:3]]
    legacy = build_typed_tokenizer(TokenizerSpec(kind, files.sp_model, legacy_tokenizer=True))
    bos = [sp.bos_id()] if kind == "Llama2Tokenizer" else []  # Megatron's legacy Llama2: BOS
    assert legacy.tokenize(CORPUS[0]) == bos + sp.encode_as_ids(CORPUS[0])


def test_gpt2_bpe_matches_the_reference_bpe(files):
    tok = build_typed_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=files.gpt2_vocab,
                                              merge_file=files.gpt2_merges))
    ref = ReferenceGPT2(files.gpt2_vocab, files.gpt2_merges)
    with open(files.gpt2_vocab) as f:
        assert tok.vocab_size == len(json.load(f)) == 320
    assert tok.eod == ref.eod
    for text in (*CORPUS, UNSEEN):
        assert tok.tokenize(text) == ref.tokenize(text), text  # <|endoftext|> is plain text
    assert tok.detokenize(tok.tokenize(UNSEEN)) == UNSEEN


def test_null_tokenizer_has_vocab_size_ids_with_eod_the_last_as_megatron_019():
    tok = build_typed_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert tok.tokenize("5 17 99") == [5, 17, 99]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.tokenize("5 101")
    with pytest.raises(ValueError, match="not token ids"):
        tok.tokenize("five")


def test_wrong_combinations_name_the_flag_value_and_expectation(files, tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1}))
    cases = [
        (TokenizerSpec("SentencePieceTokenizer", files.sp_model), "--tokenizer-type",
         "not supported"),
        (TokenizerSpec("Llama2Tokenizer"), "--tokenizer-model", "SentencePiece .model"),
        (TokenizerSpec("Llama2Tokenizer", files.gpt2_vocab), "--tokenizer-model",
         "not a SentencePiece model"),
        (TokenizerSpec("GPTSentencePieceTokenizer", str(tmp_path / "none.model")),
         "--tokenizer-model", "no such file"),
        (TokenizerSpec("HuggingFaceTokenizer", "meta-llama/Llama-2-7b-hf"), "--tokenizer-model",
         "never downloaded"),
        (TokenizerSpec("HuggingFaceTokenizer", str(empty_dir)), "--tokenizer-model",
         "holds no tokenizer"),
        (TokenizerSpec("HuggingFaceTokenizer", files.sp_model), "--tokenizer-model",
         "not a Hugging Face tokenizer JSON"),
        (TokenizerSpec("GPT2BPETokenizer", merge_file=files.gpt2_merges), "--vocab-file",
         "needs a GPT-2 vocab.json"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=files.gpt2_vocab), "--merge-file",
         "needs a GPT-2 merges.txt"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=files.gpt2_merges),
         "--vocab-file", "<|endoftext|>"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=files.sp_model,
                       merge_file=files.gpt2_merges), "--vocab-file", "not a GPT-2 vocab.json"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=files.gpt2_vocab,
                       merge_file=files.sp_model), "--merge-file", "not a GPT-2 merges.txt"),
        (TokenizerSpec("NullTokenizer"), "--vocab-size", "needs --vocab-size"),
    ]
    for spec, flag, fragment in cases:
        with pytest.raises(TokenizerFlagError) as err:
            build_typed_tokenizer(spec)
        assert err.value.flag == flag, (spec, str(err.value))
        assert fragment in err.value.problem, (spec, str(err.value))
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv, expected", [
    (["--tokenizer-type", "SentencePieceTokenizer", "--data-path", "d"],
     "--tokenizer-type SentencePieceTokenizer: Megatron's SentencePieceTokenizer is not "
     "supported here"),
    (["--tokenizer-type", "Llama3Tokenizer", "--data-path", "d"],
     "--tokenizer-type Llama3Tokenizer: expected one of HuggingFaceTokenizer"),
    (["--tokenizer-type", "NullTokenizer", "--data-path", "d"], "--vocab-size missing: "),
    (["--tokenizer-type", "GPT2BPETokenizer"],
     "--tokenizer-type GPT2BPETokenizer: needs --data-path"),
    (["--data-path", "d"], "--tokenizer-model missing: required with --data-path"),
])
def test_pretrain_tokenizer_flags_are_checked_first(argv, expected, capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-preset", "tiny", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"pretrain_llama.py: error: {expected}")


def test_pretrain_flags_reach_the_run_configuration():
    from megatron.training.arguments import parse_args

    run = parse_args(["--model-preset", "tiny", "--data-path", "d", "--tokenizer-type",
                      "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"])
    d = run.data
    assert (d.tokenizer_type, d.vocab_file, d.merge_file) == ("GPT2BPETokenizer", "v.json",
                                                                "m.txt")
    assert run.flags()["tokenizer_type"] == "GPT2BPETokenizer"


@pytest.mark.parametrize("unreadable", ["--vocab-file", "--merge-file"])
def test_a_gpt2_file_this_user_may_not_read_is_one_line(files, unreadable):
    """As another user (root reads anything): a PermissionError traceback before."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.in_child import as_nobody, error_line_in_child
    # not under pytest's directories: another user may not pass through them
    folder = Path(tempfile.mkdtemp(prefix="gpt2-unreadable-"))
    folder.chmod(0o755)
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    shutil.copy(files.gpt2_vocab, vocab)
    shutil.copy(files.gpt2_merges, merges)
    (vocab if unreadable == "--vocab-file" else merges).chmod(0)

    def build_as_nobody() -> None:
        as_nobody()
        build_typed_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=str(vocab),
                                            merge_file=str(merges)))

    path = vocab if unreadable == "--vocab-file" else merges
    try:
        line = error_line_in_child(build_as_nobody, (TokenizerFlagError,))
    finally:
        shutil.rmtree(folder)
    assert line.startswith(f"{unreadable} {path}: unreadable (Permission denied); expected a "
                           "GPT-2 ")


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer"])
def test_vocab_size_leaves_a_tokenizer_that_knows_its_vocabulary_alone_as_megatron_019(
        files, kind, tmp_path):
    """Megatron-LM 0.19 gives these tokenizers no vocab_size and pads their own: the 0.19
    LLaMA example's --vocab-size 128256 beside a small tokenizer builds the tokenizer's
    rows, not 128256, and the start says the flag had no effect."""
    from megatron.config.checks import run_notices
    from megatron.data.run_data import prepare_data
    from megatron.training.arguments import parse_args

    flags = {"HuggingFaceTokenizer": ["--tokenizer-model", files.hf_dir],
             "Llama2Tokenizer": ["--tokenizer-model", files.sp_model],
             "GPT2BPETokenizer": ["--vocab-file", files.gpt2_vocab,
                                  "--merge-file", files.gpt2_merges]}[kind]
    run = parse_args(["--model-preset", "tiny", "--train-iters", "2", "--eval-iters", "0",
                      "--mock-data", "--tokenizer-type", kind, *flags, "--vocab-size", "128256",
                      "--data-cache-path", str(tmp_path)])
    data = prepare_data(run, log=lambda line: None)
    own = data.tokenizer.vocab_size
    assert own < 512 and data.vocab_size == run.model.padded_vocab_size(own)
    assert (f"--vocab-size 128256 with --tokenizer-type {kind}: no effect (as in Megatron-LM "
            "0.19, the model's vocabulary is the tokenizer's own, padded to a multiple of "
            "--make-vocab-size-divisible-by)") in run_notices(run)
