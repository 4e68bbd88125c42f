"""From the data flags to megatron-core's datasets: which prefixes with which weights, and
how the documents split into train/validation/test.

Megatron's semantics: `--data-path 0.7 A 0.3 B` is one weighted blend split by `--split`;
`--train-data-path/--valid-data-path/--test-data-path` give each split its own (blend of)
datasets. The sample counts are Megatron's (RunConfig.split_sizes).
"""

from __future__ import annotations

from megatron.config.errors import ConfigError
from megatron.config.run import DataConfig
from megatron.config.values import parse_data_path
from megatron.data.checks import DataError, check_data_prefix
from megatron.data.datasets import DataBlend


def data_blend(data: DataConfig, default_prefix: str | None) -> DataBlend:
    """The blend the data flags ask for; `default_prefix` (the built-in corpus) without any
    data path. Every prefix is checked here, so a missing file is named with its flag."""
    split = data.split or "1,0,0"
    if data.train_data_path is None:
        values = data.data_path if data.data_path is not None else [default_prefix]
        prefixes, weights = parse_data_path("--data-path", values)
        _check_prefixes("--data-path", prefixes)
        return DataBlend(prefixes, weights, split)
    per_split = []
    for name in ("train", "valid", "test"):
        values = getattr(data, f"{name}_data_path")
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
            raise ConfigError(flag, prefix, str(exc)) from None
