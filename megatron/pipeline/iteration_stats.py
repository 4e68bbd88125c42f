"""What one rank measured in one iteration, and the pipeline's report of it.

Every field declared with `metric(...)` is a figure of the metrics file: each rank fills
it, one all-reduce gathers every rank's row, and the report gives it under the field's
name reduced over the ranks (mean, max or sum) and, with `per_rank`, rank by rank. A new
metric is one field here and the line of the executor that measures it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from megatron.offload.device import MEMORY_CATEGORIES
from megatron.optimizer.group_optimizer import IterationResult
from megatron.schedules.timeline import TimedEvent

# None: reported per rank only; "nonzero": the first rank's value that is not 0 (a signed
# code that the ranks which have one share, such as the optimizer's GPU split)
REDUCTIONS = ("mean", "max", "sum", "nonzero", None)


def metric(reduce: str | None, per_rank: bool = False, integer: bool = False,
           keys: Sequence[str] = (), optional: bool = False) -> dict:
    """A metric field: how it is reduced over the ranks, whether it is also reported per
    rank, whether it is a count, (for a dict of figures) its keys, and whether a rank may
    have none (None: left out of the reduction; None where no rank has one)."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce={reduce!r}, expected one of {REDUCTIONS}")
    if optional and (keys or reduce not in ("max", None)):
        raise ValueError("an optional metric is a single figure reduced by max (or not)")
    return field(default=None if optional else 0,
                 metadata={"reduce": reduce, "per_rank": per_rank, "integer": integer,
                           "keys": tuple(keys), "optional": optional})


@dataclass
class IterationStats:
    loss: float  # mean over micro-batches (0.0 on ranks without the last forward stage)
    result: IterationResult
    events: list[TimedEvent] = field(default_factory=list)  # when recorded
    origin_host_s: float = 0.0  # time.perf_counter() at the iteration's start: events' zero

    # --- metrics ---------------------------------------------------------------------
    gpu_time_s: float = metric("mean", per_rank=True)  # on the compute stream
    # the main thread waiting for optimizer work (the rest is bubbles); the report moves a
    # rank's wait for its peers at the verdict to its bubble (attribute_peer_waits)
    exposed_optimizer_time_s: float = metric("mean", per_rank=True)
    bubble_time_s: float = metric("mean", per_rank=True)
    # S Eq. 1-3 (as the simulator): the share of the iteration the GPU is not computing
    bubble_ratio: float = metric("mean")
    host_syncs: int = metric("max", per_rank=True, integer=True)  # main thread on the device
    device_memory_peak_bytes: int = metric("max", per_rank=True, integer=True)  # MemoryBook
    device_memory_at_peak: dict = metric(None, per_rank=True, integer=True,
                                         keys=MEMORY_CATEGORIES)  # by category, at the peak
    # CUDA's caching allocator's own peak (everything torch allocated on the GPU, the
    # kernels' temporaries included); None on the CPU device layer
    device_allocator_peak_bytes: int | None = metric("max", per_rank=True, integer=True,
                                                     optional=True)
    # Of the exposed optimizer time: the main thread waiting for the previous iteration's
    # deferred clipping corrections / rollbacks (before a forward of a stage not yet
    # corrected); waiting after the CPU's part was done, for device subgroups; the rest.
    clip_corrections_exposed_s: float = metric("mean")
    exposed_optimizer_device_time_s: float = metric("mean")
    exposed_optimizer_cpu_time_s: float = metric("mean")
    # The main thread in the verdict's all-reduce (POST_STEP_SYNC / OVERFLOW_SYNC), and the
    # part of it the report counts as bubble, not optimizer (attribute_peer_waits).
    verdict_wait_s: float = metric("mean", per_rank=True)
    verdict_peer_wait_s: float = metric("mean", per_rank=True)
    optimizer_gpu_stride: int = metric("nonzero", integer=True)  # split: K, -N (device:N), 0
    # parameter bytes prefetched from the host store into device slots
    h2d_parameter_bytes: int = metric("sum", per_rank=True, integer=True)


def _metrics() -> list:
    return [f for f in fields(IterationStats) if "reduce" in f.metadata]


def _row(stats: IterationStats) -> list[float]:
    row = []
    for f in _metrics():
        value = getattr(stats, f.name)
        if value is None:  # an optional metric this rank does not have
            row.append(float("nan"))
            continue
        row += [float(value[k]) for k in f.metadata["keys"]] if f.metadata["keys"] \
            else [float(value)]
    return row


def _unpack(values: torch.Tensor) -> dict:
    """A rank's row back into {field: value}."""
    out, at = {}, 0
    for f in _metrics():
        keys, cast = f.metadata["keys"], int if f.metadata["integer"] else float
        if keys:
            out[f.name] = {k: cast(values[at + i]) for i, k in enumerate(keys)}
            at += len(keys)
        else:
            value = float(values[at])
            out[f.name] = None if value != value else cast(value)  # NaN: none on this rank
            at += 1
    return out


def attribute_peer_waits(rows: list[dict]) -> None:
    """Count each rank's wait in the verdict's all-reduce for its peers as bubble.

    The all-reduce returns on every rank once the last one has joined it, so the rank that
    joins last waits only for the reduction itself: the least `verdict_wait_s` of the
    pipeline. What another rank waits beyond that is its peers still running their last
    backwards (a drain bubble) and their own last steps (each peer's exposed optimizer
    time, counted on that peer): it moves from the rank's exposed optimizer time to its
    bubble time and is reported as `verdict_peer_wait_s`. The simulator draws the same
    line: optimizer work is exposed only after the last compute. Without clocks shared by
    the ranks, the least wait is what tells the two apart."""
    reduction = min(row["verdict_wait_s"] for row in rows)
    for row in rows:
        peers = row["verdict_wait_s"] - reduction
        row["verdict_peer_wait_s"] = peers
        row["exposed_optimizer_time_s"] -= peers
        row["exposed_optimizer_cpu_time_s"] -= peers
        row["bubble_time_s"] += peers


def pipeline_report(stats: IterationStats, rank: int, ranks: int, has_loss: bool,
                    group: dist.ProcessGroup | None) -> tuple[float, dict]:
    """All-reduce every rank's metrics over the pipeline `group` (and the loss from the
    rank of the last forward stage): (the loss, the metrics-file fields)."""
    row = _row(stats)
    table = torch.zeros(ranks + 1, len(row), dtype=torch.float64)
    table[rank] = torch.tensor(row, dtype=torch.float64)
    table[ranks, 0] = stats.loss if has_loss else 0.0
    dist.all_reduce(table, group=group)
    rows = [_unpack(table[r]) for r in range(ranks)]
    attribute_peer_waits(rows)
    report: dict = {"per_rank": [{"rank": r} for r in range(ranks)]}
    for f in _metrics():
        values = [row[f.name] for row in rows]
        reduce, cast = f.metadata["reduce"], int if f.metadata["integer"] else float
        if reduce == "mean":
            report[f.name] = cast(sum(values) / ranks)
        elif reduce == "max":
            present = [v for v in values if v is not None]
            report[f.name] = max(present) if present else None
        elif reduce == "sum":
            report[f.name] = sum(values)
        elif reduce == "nonzero":
            report[f.name] = next((v for v in values if v), cast(0))
        if f.metadata["per_rank"]:
            for entry, value in zip(report["per_rank"], values):
                entry[f.name] = value
    return float(table[ranks, 0]), report
