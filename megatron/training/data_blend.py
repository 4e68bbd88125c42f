"""From the data flags to megatron-core's datasets: which prefixes with which weights, how
the documents split into train/validation/test, and how many samples each split needs.

Megatron's semantics: `--data-path 0.7 A 0.3 B` is one weighted blend split by `--split`;
`--train-data-path/--valid-data-path/--test-data-path` give each split its own (blend of)
datasets. The sample counts are Megatron's: train_iters x global batch for training,
(train_iters // eval_interval + 1) x eval_iters x global batch for validation (every
evaluation reads new batches), eval_iters x global batch for the test set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.training.arguments import ArgumentError, parse_data_path
from megatron.training.data_checks import DataError, check_data_prefix
from megatron.training.train_dataset import DataBlend


@dataclass(frozen=True)
class Datasets:
    """The three splits (None where there is none)."""

    train: object
    valid: object | None
    test: object | None


def data_blend_from_args(args: argparse.Namespace, default_prefix: str | None) -> DataBlend:
    """The blend the flags ask for; `default_prefix` (the built-in corpus) without any data
    path. Every prefix is checked here, so a missing file is named with its flag."""
    split = args.split or "1,0,0"
    if args.train_data_path is None:
        values = args.data_path if args.data_path is not None else [default_prefix]
        prefixes, weights = parse_data_path("--data-path", values)
        _check_prefixes("--data-path", prefixes)
        return DataBlend(prefixes, weights, split)
    per_split = []
    for name in ("train", "valid", "test"):
        values = getattr(args, f"{name}_data_path")
        if values is None:
            per_split.append(None)
            continue
        prefixes, weights = parse_data_path(f"--{name}-data-path", values)
        _check_prefixes(f"--{name}-data-path", prefixes)
        per_split.append((prefixes, weights))
    return DataBlend(per_split=per_split)


def _check_prefixes(flag: str, prefixes: list[str]) -> None:
    for prefix in prefixes:
        try:
            check_data_prefix(prefix)
        except DataError as exc:
            raise ArgumentError(flag, prefix, str(exc)) from None


def evaluations(args: argparse.Namespace) -> int:
    """How many evaluations a run makes: one per interval, plus the one at the end."""
    if args.eval_iters <= 0:
        return 0
    return args.train_iters // args.eval_interval + 1


def split_sizes(args: argparse.Namespace) -> list[int]:
    """Samples each split must provide (Megatron's formula, see the module docstring)."""
    batch = args.global_batch_size
    return [args.train_iters * batch, evaluations(args) * args.eval_iters * batch,
            args.eval_iters * batch]
