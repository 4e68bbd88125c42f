"""Tokenizer files of each Megatron --tokenizer-type, built locally from a small corpus (no
downloads), and a pure-Python GPT-2 BPE as the reference for GPT2BPETokenizer."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from functools import lru_cache

import regex
import sentencepiece
from tokenizers import (
    ByteLevelBPETokenizer,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

CORPUS = [
    f"Document {i}: the {animal} jumps over the {thing}, {i * 7} times in a row."
    for i, (animal, thing) in enumerate(
        [("fox", "dog"), ("cat", "fence"), ("cow", "moon"), ("frog", "log")] * 15
    )
] + ["Ünïcödé text, tabs\tand  double spaces, emoji 🎉 and CJK 漢字.",
     "def add(a, b):\n    return a + b\n"]


@dataclass(frozen=True)
class TokenizerFiles:
    hf_dir: str  # save_pretrained: tokenizer.json + tokenizer_config.json, BOS by its template
    sp_model: str  # SentencePiece BPE .model
    gpt2_vocab: str  # vocab.json of a byte-level BPE with <|endoftext|>
    gpt2_merges: str  # merges.txt


def build_tokenizer_files(root: str) -> TokenizerFiles:
    hf_dir = os.path.join(root, "hf")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|pad|>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            pad_token="<|pad|>").save_pretrained(hf_dir)

    sp_model = os.path.join(root, "sp.model")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=150, model_type="bpe",
        character_coverage=1.0, minloglevel=2)
    with open(sp_model, "wb") as f:
        f.write(model.getvalue())

    gpt2_dir = os.path.join(root, "gpt2")
    os.makedirs(gpt2_dir)
    gpt2 = ByteLevelBPETokenizer()
    gpt2.train_from_iterator(CORPUS, vocab_size=320, special_tokens=["<|endoftext|>"],
                             show_progress=False)
    gpt2.save_model(gpt2_dir)
    return TokenizerFiles(hf_dir, sp_model, os.path.join(gpt2_dir, "vocab.json"),
                          os.path.join(gpt2_dir, "merges.txt"))


@lru_cache
def _byte_symbols() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


class ReferenceGPT2:
    """GPT-2 byte-level BPE as published (and as Megatron's legacy GPT2Tokenizer runs it):
    the regex split, bytes to symbols, lowest-rank merges first."""

    PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merges_file, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.eod = self.encoder["<|endoftext|>"]

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get(p, float("inf")), i)
                     for i, p in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            first, second = parts[i], parts[i + 1]
            merged, j = [], 0
            while j < len(parts):  # every occurrence of the pair, left to right
                if j < len(parts) - 1 and parts[j] == first and parts[j + 1] == second:
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return parts

    def tokenize(self, text: str) -> list[int]:
        symbols = _byte_symbols()
        ids = []
        for piece in self.PATTERN.findall(text):
            word = "".join(symbols[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[p] for p in self._bpe(word))
        return ids
