"""How the model's pieces are cut into forward stages and backward sub-stages.

The model is: embedding, decoder layers 0..L-1, head (final norm + output layer + loss).
A partition lists decoder layers per forward stage; the embedding goes with stage 0 and
the head with the last stage. Backward stage (i, k) is the k-th contiguous sub-range of
stage i's layers; (0, 0) holds the embedding and (S-1, d-1) the head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerRange:
    """The decoder layers [first, first + count) of one (sub-)stage, plus the ends."""

    first: int
    count: int
    has_embedding: bool
    has_head: bool

    @property
    def stop(self) -> int:
        return self.first + self.count


def check_partition(partition: list[int] | tuple[int, ...], forward_stages: int) -> None:
    if len(partition) != forward_stages:
        raise ValueError(
            f"partition has {len(partition)} entries, expected one per forward stage "
            f"({forward_stages})"
        )
    for stage, layers in enumerate(partition):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"partition entry {stage} is {layers!r}, expected an integer >= 1")


def balanced_partition(
    num_layers: int,
    forward_stages: int,
    layer_cost: float = 1.0,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
) -> list[int]:
    """Layers per forward stage so that stage costs (embedding and head included) are even.

    Stage boundaries sit where the cumulative cost is closest to j/S of the total, with at
    least one layer per stage; every stage's cost is then within one layer of the ideal.
    """
    if forward_stages < 1:
        raise ValueError(f"forward_stages is {forward_stages}, expected >= 1")
    if num_layers < forward_stages:
        raise ValueError(
            f"num_layers is {num_layers}, expected at least one per forward stage "
            f"({forward_stages})"
        )
    if layer_cost <= 0 or embedding_cost < 0 or head_cost < 0:
        raise ValueError("layer_cost must be > 0 and embedding/head costs >= 0")
    total = embedding_cost + num_layers * layer_cost + head_cost
    boundaries = [0]
    for j in range(1, forward_stages):
        target = total * j / forward_stages
        lowest = boundaries[-1] + 1
        highest = num_layers - (forward_stages - j)
        ideal = (target - embedding_cost) / layer_cost
        boundaries.append(min(highest, max(lowest, round(ideal))))
    boundaries.append(num_layers)
    return [b - a for a, b in zip(boundaries, boundaries[1:])]


def sub_stage_layers(partition: list[int] | tuple[int, ...], backward_split: int) -> dict:
    """{(stage, sub): LayerRange} for every backward stage, in model order.

    A stage's layers are split as evenly as possible; earlier sub-stages take the extra
    layers because the last one of the last stage also carries the head.
    """
    if backward_split < 1:
        raise ValueError(f"backward_split is {backward_split}, expected >= 1")
    ranges = {}
    first = 0
    last_stage = len(partition) - 1
    for stage, layers in enumerate(partition):
        if backward_split > layers:
            raise ValueError(
                f"backward split {backward_split} is larger than the {layers} layers of "
                f"forward stage {stage}"
            )
        base, extra = divmod(layers, backward_split)
        for sub in range(backward_split):
            count = base + (1 if sub < extra else 0)
            ranges[(stage, sub)] = LayerRange(
                first=first,
                count=count,
                has_embedding=(stage == 0 and sub == 0),
                has_head=(stage == last_stage and sub == backward_split - 1),
            )
            first += count
    return ranges


def stage_layers(partition: list[int] | tuple[int, ...]) -> list[LayerRange]:
    """The LayerRange of each forward stage."""
    return list(sub_stage_layers(partition, 1).values())
