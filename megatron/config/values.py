"""The grammar of the flags whose values are small languages: Megatron's --split and its
data paths (a prefix, several, or weighted pairs)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron.config.errors import ConfigError


def parse_split(text: str) -> tuple[float, float, float]:
    """Megatron's --split: up to three non-negative weights (missing ones are 0), not all 0;
    commas or slashes between them. Quotes around them are ignored, as Megatron's parser
    (which reads only the numbers) ignores them: its launch scripts write "--split '99,1,0'"
    inside a bash array, and the quotes reach the program."""
    parts = text.strip().strip("'\"").replace("/", ",").split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) \
            or sum(weights) <= 0:
        raise ConfigError("--split", text, "expected up to three non-negative weights "
                          "TRAIN,VALID,TEST, not all 0 (e.g. 969,30,1)")
    weights += [0.0] * (3 - len(weights))
    return weights[0], weights[1], weights[2]


def parse_data_path(flag: str, values: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's data path: one PREFIX, several PREFIXes (equal weights) or
    'WEIGHT PREFIX WEIGHT PREFIX ...'; returns (prefixes, weights or None)."""
    values = list(values)
    try:
        float(values[0])
    except ValueError:
        return values, None  # prefixes only: megatron-core weighs them by their sizes
    weights = []
    for text in values[0::2]:
        try:
            weights.append(float(text))
        except ValueError:
            weights.append(math.nan)
    if len(values) % 2 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(flag, " ".join(values),
                          "expected PREFIX or pairs 'WEIGHT PREFIX' with weights > 0")
    return values[1::2], weights
