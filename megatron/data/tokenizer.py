"""Offline tokenizers: train a byte-level BPE with Hugging Face `tokenizers`, load it for
megatron.core's GPTDataset.

A tokenizer is one JSON file (the `tokenizers` serialization). Byte-level BPE needs no
normalization or unknown token: every string round-trips exactly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron.common.files import atomic_write, missing_file
from megatron.common.progress import progress_enabled

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Names other tokenizer.json files use for the end of a document / padding, so that a
# user's own Hugging Face tokenizer also loads (first match wins).
EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "[PAD]")
# megatron.core's "no pad token" value: never a real token id, so no sample is masked by it.
NO_PAD_ID = -1
# 256 byte symbols plus the two special tokens.
MIN_VOCAB_SIZE = 256 + 2


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or not usable for training."""


class HFTokenizer(MegatronTokenizerBase):
    """A Hugging Face `tokenizers` JSON file seen through megatron.core's tokenizer interface.

    GPTDataset reads `vocab_size`, `eod` and `pad` from it; training code uses `tokenize`.
    """

    def __init__(self, path: str, tokenizer: Tokenizer) -> None:
        super().__init__(path, config={})
        self._tokenizer = tokenizer
        # Text that spells a special token ("<|endoftext|>" in a web page) stays ordinary text:
        # only the data pipeline inserts the real end-of-document id between documents.
        self._tokenizer.encode_special_tokens = True
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._eod = _first_token_id(tokenizer, EOD_CANDIDATES)
        if self._eod is None:
            raise TokenizerError(
                f"tokenizer '{path}': expected an end-of-document token, one of "
                f"{', '.join(EOD_CANDIDATES)}"
            )
        pad = _first_token_id(tokenizer, PAD_CANDIDATES)
        self._pad = NO_PAD_ID if pad is None else pad
        self._content_hash = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """What megatron.core hashes into the name of GPTDataset's index cache."""
        return {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "tokenizer_sha256": self._content_hash,
        }

    def to_json(self) -> str:
        """The tokenizer file's content (a checkpoint carries it for exports)."""
        return self._tokenizer.to_str()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize many texts at once on the `tokenizers` thread pool (RAYON_NUM_THREADS)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *conversation, **options):
        raise NotImplementedError("pretraining tokenizers have no chat template")


def _first_token_id(tokenizer: Tokenizer, names: Iterable[str]) -> int | None:
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def load_tokenizer(path: str) -> HFTokenizer:
    """Load a tokenizer JSON (from tools/train_tokenizer.py or any Hugging Face tokenizer.json).

    Raises TokenizerError naming the path and what was expected.
    """
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer '{path}': {missing_file(path)} (expected a tokenizer "
                             "JSON; a Hugging Face directory with --tokenizer-type "
                             "HuggingFaceTokenizer)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception on malformed JSON
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(
            f"tokenizer '{path}': not a valid Hugging Face tokenizers JSON ({first_line})"
        ) from None
    return HFTokenizer(path, tokenizer)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output_path: str) -> HFTokenizer:
    """Train a byte-level BPE on `texts` and write it atomically to `output_path`.

    Deterministic: the same texts in the same order give the same file.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab size {vocab_size}: expected at least {MIN_VOCAB_SIZE} "
            "(256 byte symbols and 2 special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Special tokens first: pad = 0, eod = 1, matching megatron's habit of small ids.
        special_tokens=[PAD_TOKEN, EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=progress_enabled(),  # the tokenizers library's own bars
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    text = tokenizer.to_str()
    atomic_write(output_path, lambda stream: stream.write(text.encode("utf-8")))
    return HFTokenizer(output_path, tokenizer)

