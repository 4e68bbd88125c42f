"""The data of one run: its tokenizer and its train, validation and test datasets, from the
data flags (the built-in demo corpus when no path is given). Bad input is named by its
flag (ConfigError) before anything else is built."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron.config.errors import ConfigError
from megatron.config.run import RunConfig
from megatron.data.blend import data_blend
from megatron.data.cache import CACHE_FLAG
from megatron.data.checks import DataError
from megatron.data.datasets import build_datasets, build_mock_datasets
from megatron.data.demo_corpus import ensure_demo_corpus
from megatron.data.tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from megatron.data.tokenizer_types import (
    TokenizerFlagError,
    TokenizerSpec,
    TypedTokenizer,
    build_typed_tokenizer,
)


@dataclass(frozen=True)
class Datasets:
    """The three splits (None where there is none)."""

    train: object
    valid: object | None
    test: object | None


@dataclass(frozen=True)
class RunData:
    tokenizer: HFTokenizer | TypedTokenizer
    datasets: Datasets
    # the model's rows: --vocab-size or the tokenizer's (NullTokenizer: --vocab-size), padded
    # as Megatron pads them
    vocab_size: int


def prepare_data(run: RunConfig, log: Callable[[str], object] = print) -> RunData:
    """The tokenizer and the datasets; the demo corpus when no data path is given."""
    d = run.data
    default_prefix, tokenizer_path = None, d.tokenizer_model
    if d.data_path is None and d.train_data_path is None and not (
            d.mock_data and d.tokenizer_type):
        corpus = ensure_demo_corpus(cache_dir=d.data_cache_dir, log=log)
        default_prefix = corpus.data_prefix
        if d.tokenizer_model is None:
            tokenizer_path = corpus.tokenizer_path
    blend = None if default_prefix is None and d.mock_data else data_blend(d, default_prefix)
    tokenizer = build_run_tokenizer(run, tokenizer_path)
    log(f"tokenizer: {d.tokenizer_type or 'tokenizer JSON'} "
        f"({tokenizer_path or d.vocab_file or 'no files'}), vocabulary {tokenizer.vocab_size}, "
        f"end of document {tokenizer.eod}")
    # Megatron's NullTokenizer reads --vocab-size as its own size (0.19: ids 0..N-1, eod N-1);
    # the other types ignore it (RunConfig.vocab_size_given)
    vocab = (tokenizer.vocab_size if d.tokenizer_type == "NullTokenizer"
             else run.vocab_size_given or tokenizer.vocab_size)
    if vocab < tokenizer.vocab_size:
        raise ConfigError("--vocab-size", vocab,
                          f"must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})")
    vocab = run.model.padded_vocab_size(vocab)
    flag = "--data-path" if d.train_data_path is None else "--train-data-path"
    try:
        if d.mock_data:
            train_ds, valid_ds, test_ds = build_mock_datasets(
                tokenizer, run.model.seq_length, run.split_sizes, run.training.seed,
                cache_dir=d.data_cache_dir)
        else:
            train_ds, valid_ds, test_ds = build_datasets(
                blend, tokenizer, run.model.seq_length, run.split_sizes, run.training.seed,
                cache_dir=d.data_cache_dir,
            )
    except DataError as exc:
        if default_prefix is not None:  # the demo corpus: the user gave no --data-path
            raise ConfigError(CACHE_FLAG, d.data_cache_dir,
                              f"{exc} (the demo corpus in this cache: remove "
                              f"{os.path.dirname(default_prefix)} to rebuild it)"
                              ) from None
        raise ConfigError(flag, " ".join(blend.all_prefixes()), str(exc)) from None
    if train_ds is None:
        raise ConfigError("--split" if d.split else flag, d.split or "missing",
                          "expected a training share (the first weight) above 0")
    if run.eval_iters > 0 and valid_ds is None:
        raise ConfigError("--eval-iters", run.eval_iters,
                          "the validation split is empty: give --split a validation share "
                          "or --valid-data-path")
    return RunData(tokenizer, Datasets(train_ds, valid_ds, test_ds), vocab)


def build_run_tokenizer(run: RunConfig, tokenizer_path: str | None
                        ) -> HFTokenizer | TypedTokenizer:
    """--tokenizer-type's tokenizer, or (without one) the tokenizer JSON at tokenizer_path."""
    d = run.data
    if d.tokenizer_type is None:
        try:
            return load_tokenizer(tokenizer_path)
        except (TokenizerError, OSError) as exc:
            raise ConfigError("--tokenizer-model", tokenizer_path, str(exc)) from None
    spec = TokenizerSpec(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file,
                         run.model.vocab_size)
    try:
        return build_typed_tokenizer(spec)
    except TokenizerFlagError as exc:
        raise ConfigError(exc.flag, exc.value, exc.problem) from None
