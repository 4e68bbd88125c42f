"""Megatron-LM's tokenizers by their `--tokenizer-type` names, with Megatron-LM 0.19's
meanings (the `megatron.core.tokenizers` system its tools/preprocess_data.py uses by
default), all read from local files:

| type | files | tokenize(text) | eod | vocab_size |
|---|---|---|---|---|
| HuggingFaceTokenizer | --tokenizer-model DIR (save_pretrained) or tokenizer JSON | no BOS/EOS (with special tokens: --tokenizer-hf-include-special-tokens or --legacy-tokenizer) | eos_token | len(tokenizer), added tokens included |
| Llama2Tokenizer | --tokenizer-model SentencePiece .model | no BOS (BOS first with --legacy-tokenizer) | eos_id | pieces |
| GPTSentencePieceTokenizer | --tokenizer-model SentencePiece .model | no BOS | eos_id | pieces |
| GPT2BPETokenizer | --vocab-file vocab.json, --merge-file merges.txt | GPT-2 byte-level BPE | <|endoftext|> | entries of vocab.json |
| NullTokenizer | --vocab-size N | the integers of the text ("5 17 3") | N - 1 | N (0.16: eod N, N + 1) |

A wrong combination raises TokenizerFlagError naming the flag, the value and what was
expected; nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron.config.tokenizer_names import tokenizer_type_problem
from megatron.data.tokenizer import (
    EOD_CANDIDATES,
    NO_PAD_ID,
    PAD_CANDIDATES,
    TokenizerError,
)

GPT2_EOD = "<|endoftext|>"
# The files of a tokenizer directory that identify it (a model directory's weights are not
# read to name a dataset cache).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json")


class TokenizerFlagError(TokenizerError):
    """A tokenizer flag whose value does not fit its --tokenizer-type."""

    def __init__(self, flag: str, value: object, problem: str) -> None:
        super().__init__(f"{flag} {value}: {problem}")
        self.flag, self.value, self.problem = flag, value, problem


@dataclass(frozen=True)
class TokenizerSpec:
    """Megatron's tokenizer flags (argparse names)."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer: ids 0..N-1, eod N-1 (Megatron 0.19)
    tokenizer_hf_use_fast: bool = False
    tokenizer_hf_include_special_tokens: bool = False
    legacy_tokenizer: bool = False


class TypedTokenizer(MegatronTokenizerBase):
    """What GPTDataset and the preprocessing read: vocab_size, eod, pad, tokenize."""

    def __init__(self, kind: str, paths: Iterable[str | None], vocab_size: int,
                 eod: int | None, pad: int | None, bos: int | None = None) -> None:
        paths = [p for p in paths if p]
        super().__init__(paths[0] if paths else kind, config={})  # sets .path
        self.kind = kind
        self._vocab_size, self._eod, self._bos = vocab_size, eod, bos
        self._pad = NO_PAD_ID if pad is None or pad < 0 else pad
        digest = hashlib.sha256(kind.encode())
        for path in paths:
            if path and os.path.isfile(path):
                with open(path, "rb") as f:
                    digest.update(f.read())
            elif path and os.path.isdir(path):
                for name in _TOKENIZER_FILES:
                    full = os.path.join(path, name)
                    if os.path.isfile(full):
                        digest.update(name.encode())
                        with open(full, "rb") as f:
                            digest.update(f.read())
        self._content_hash = digest.hexdigest()

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """What megatron.core hashes into the name of GPTDataset's index cache."""
        return {"class": f"{type(self).__module__}.{self.kind}",
                "tokenizer_sha256": self._content_hash}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError(f"{self.kind} has no vocabulary listing here")

    @property
    def eod(self) -> int | None:
        return self._eod

    @property
    def eos(self) -> int | None:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str | None:
        """A tokenizers JSON a checkpoint may carry for exports (None: not that kind)."""
        return None

    def apply_chat_template(self, *conversation, **options):
        raise NotImplementedError("pretraining tokenizers have no chat template")


class _HuggingFace(TypedTokenizer):
    def __init__(self, spec: TokenizerSpec, tokenizer, eod: int | None, path: str) -> None:
        self._tokenizer = tokenizer
        self._special = spec.tokenizer_hf_include_special_tokens or spec.legacy_tokenizer
        super().__init__(spec.tokenizer_type, [path], len(tokenizer), eod,
                         tokenizer.pad_token_id, tokenizer.bos_token_id)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._special or not self._tokenizer.is_fast:
            return [self._one(text) for text in texts]
        # The fast backend encodes a batch on its thread pool; the same ids as Megatron's
        # convert_tokens_to_ids(tokenize(text)) (tests/test_preprocess.py compares bytes).
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _one(self, text: str) -> list[int]:
        if self._special:
            return self._tokenizer(text).input_ids
        return self._tokenizer.convert_tokens_to_ids(self._tokenizer.tokenize(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def to_json(self) -> str | None:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None


class _SentencePiece(TypedTokenizer):
    def __init__(self, spec: TokenizerSpec, processor) -> None:
        self._sp = processor
        self._add_bos = spec.tokenizer_type == "Llama2Tokenizer" and spec.legacy_tokenizer
        super().__init__(spec.tokenizer_type, [spec.tokenizer_model], processor.get_piece_size(),
                         processor.eos_id(), processor.pad_id(), processor.bos_id())

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        threads = int(os.environ.get("RAYON_NUM_THREADS", "0") or 0) or -1
        batch = self._sp.encode(texts, num_threads=threads)
        return [[self._bos, *ids] for ids in batch] if self._add_bos else batch

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode_ids(list(ids))


class _GPT2BPE(TypedTokenizer):
    def __init__(self, spec: TokenizerSpec, tokenizer, vocab: dict[str, int]) -> None:
        self._tokenizer = tokenizer
        super().__init__(spec.tokenizer_type, [spec.vocab_file, spec.merge_file], len(vocab),
                         vocab[GPT2_EOD], None)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str | None:
        return self._tokenizer.to_str()


class _Null(TypedTokenizer):
    def __init__(self, spec: TokenizerSpec) -> None:
        n = int(spec.vocab_size)  # Megatron-LM 0.19: N ids, the last the end of document
        super().__init__(spec.tokenizer_type, [], n, n - 1, None)
        self._content_hash = f"null-{n}"

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            try:
                ids = [int(x) for x in text.split(" ")]
            except ValueError:
                raise TokenizerError(
                    f"NullTokenizer: text {text[:40]!r} is not token ids separated by single "
                    "spaces (NullTokenizer reads the ids from the data)") from None
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            if bad:
                raise TokenizerError(
                    f"NullTokenizer: token id {bad[0]} is outside the vocabulary 0.."
                    f"{self._vocab_size - 1} (--vocab-size {self._vocab_size}, the last id "
                    "the end of document)")
            out.append(ids)
        return out

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_typed_tokenizer(spec: TokenizerSpec) -> TypedTokenizer:
    """The tokenizer Megatron's flags name; TokenizerFlagError for a wrong combination."""
    kind = spec.tokenizer_type
    problem = tokenizer_type_problem(kind)
    if problem:
        raise TokenizerFlagError("--tokenizer-type", kind, problem)
    if kind == "NullTokenizer":
        if spec.vocab_size is None or spec.vocab_size < 2:
            raise TokenizerFlagError("--vocab-size", spec.vocab_size or "missing",
                                     "NullTokenizer needs --vocab-size N >= 2 (ids 0..N-1 in "
                                     "the data, N-1 the end of document)")
        return _Null(spec)
    if kind == "GPT2BPETokenizer":
        return _build_gpt2(spec)
    model = spec.tokenizer_model
    if model is None:
        expected = ("a SentencePiece .model file" if kind != "HuggingFaceTokenizer" else
                    "a local tokenizer directory (save_pretrained) or tokenizer JSON file")
        raise TokenizerFlagError("--tokenizer-model", "missing", f"{kind} needs {expected}")
    if kind == "HuggingFaceTokenizer":
        return _build_huggingface(spec)
    return _build_sentencepiece(spec)


def _build_sentencepiece(spec: TokenizerSpec) -> TypedTokenizer:
    path = spec.tokenizer_model
    if not os.path.isfile(path):
        raise TokenizerFlagError("--tokenizer-model", path,
                                 f"no such file (expected a SentencePiece .model file for "
                                 f"{spec.tokenizer_type})")
    import sentencepiece

    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError):
        raise TokenizerFlagError("--tokenizer-model", path,
                                 f"not a SentencePiece model (expected a .model file for "
                                 f"{spec.tokenizer_type})") from None
    if processor.eos_id() < 0:
        raise TokenizerFlagError("--tokenizer-model", path,
                                 "the SentencePiece model has no end-of-sentence piece "
                                 "(Megatron's end of document); expected eos_id >= 0")
    return _SentencePiece(spec, processor)


def _build_huggingface(spec: TokenizerSpec) -> TypedTokenizer:
    path = spec.tokenizer_model
    if not os.path.exists(path):
        raise TokenizerFlagError("--tokenizer-model", path,
                                 "not a local path (expected a directory saved by "
                                 "save_pretrained or a tokenizer JSON file; tokenizers are "
                                 "never downloaded from a hub)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, name)) for name in
                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            raise TokenizerFlagError("--tokenizer-model", path,
                                     "the directory holds no tokenizer (expected tokenizer.json "
                                     "or tokenizer_config.json, as save_pretrained writes)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                path, use_fast=spec.tokenizer_hf_use_fast, local_files_only=True)
        except Exception as err:  # transformers raises many kinds for a broken directory
            raise TokenizerFlagError("--tokenizer-model", path,
                                     f"not a loadable Hugging Face tokenizer directory "
                                     f"({_first_line(err)})") from None
        return _HuggingFace(spec, tokenizer, tokenizer.eos_token_id, path)
    try:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as err:
        raise TokenizerFlagError("--tokenizer-model", path,
                                 f"not a Hugging Face tokenizer JSON file ({_first_line(err)})"
                                 ) from None
    # A bare JSON names no eos_token: the end of document is found by its usual names.
    vocab = tokenizer.get_vocab()
    eod = next((vocab[n] for n in EOD_CANDIDATES if n in vocab), None)
    pad = next((vocab[n] for n in PAD_CANDIDATES if n in vocab), None)
    if pad is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    return _HuggingFace(spec, tokenizer, eod, path)


def _build_gpt2(spec: TokenizerSpec) -> TypedTokenizer:
    for flag, path, what in (("--vocab-file", spec.vocab_file, "vocab.json"),
                             ("--merge-file", spec.merge_file, "merges.txt")):
        if path is None:
            raise TokenizerFlagError(flag, "missing", f"GPT2BPETokenizer needs a GPT-2 {what}")
        if not os.path.isfile(path):
            raise TokenizerFlagError(flag, path, f"no such file (expected a GPT-2 {what})")
    try:
        with open(spec.vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError):
        vocab = None
    except OSError as err:
        raise TokenizerFlagError("--vocab-file", spec.vocab_file,
                                 f"unreadable ({err.strerror}); expected a GPT-2 vocab.json"
                                 ) from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerFlagError("--vocab-file", spec.vocab_file,
                                 "not a GPT-2 vocab.json (expected a JSON object token -> id)")
    if GPT2_EOD not in vocab:
        raise TokenizerFlagError("--vocab-file", spec.vocab_file,
                                 f"no {GPT2_EOD} token (GPT2BPETokenizer's end of document)")
    try:
        with open(spec.merge_file, encoding="utf-8") as f:
            # As Megatron's GPT2Tokenizer reads it: the first line (#version) and the part
            # after the last newline are not merges.
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
    except UnicodeDecodeError:  # a binary file given by mistake
        merges = None
    except OSError as err:
        raise TokenizerFlagError("--merge-file", spec.merge_file,
                                 f"unreadable ({err.strerror}); expected a GPT-2 merges.txt"
                                 ) from None
    if merges is None or any(len(m) != 2 for m in merges):
        raise TokenizerFlagError("--merge-file", spec.merge_file,
                                 "not a GPT-2 merges.txt (expected two symbols per line after "
                                 "a #version line)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    except Exception as err:
        raise TokenizerFlagError("--merge-file", spec.merge_file,
                                 f"merges do not fit --vocab-file ({_first_line(err)})") from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _GPT2BPE(spec, tokenizer, vocab)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__
