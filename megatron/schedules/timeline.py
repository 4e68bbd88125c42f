"""Timed events of a pipeline iteration and their pictures.

The simulator produces `TimedEvent`s; the executor produces the same type from measured
runs, so both draw with `write_timeline_png` (SysX Fig. 1/2/8 style: a compute row per
rank plus rows for its copy streams, network and CPU optimizer; blocks coloured by stage
and labelled with the micro-batch) and export with `write_chrome_trace` (open it in
chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron.common.files import atomic_write

# Rows of one rank, top to bottom.
RESOURCES = ("compute", "h2d", "d2h", "network", "cpu-optimizer", "device-optimizer")


@dataclass(frozen=True)
class TimedEvent:
    """One interval on one resource of one rank.

    resource: one of RESOURCES. kind: "forward", "backward", "prefetch", "offload",
    "optimizer", "p2p" (or anything else an executor measures). label: short text drawn
    in the block (e.g. "f4", "b7,1", "p7,1", "o7,1"). stage/sub/mb: -1 where not relevant.
    Times are in the unit of the cost model (simulation) or seconds (measurement).
    """

    rank: int
    resource: str
    start: float
    end: float
    label: str
    kind: str
    stage: int = -1
    sub: int = -1
    mb: int = -1


def write_chrome_trace(events: Iterable[TimedEvent], path: str, time_scale: float = 1e6) -> None:
    """Chrome trace JSON: one process per rank, one thread per resource.

    time_scale converts event times to microseconds (1e6 for seconds).
    """
    records = []
    rows = set()
    for event in events:
        rows.add((event.rank, event.resource))
        records.append({
            "name": event.label, "cat": event.kind, "ph": "X",
            "ts": event.start * time_scale, "dur": (event.end - event.start) * time_scale,
            "pid": event.rank, "tid": RESOURCES.index(event.resource)
            if event.resource in RESOURCES else len(RESOURCES),
            "args": {"stage": event.stage, "sub": event.sub, "mb": event.mb},
        })
    for rank, resource in sorted(rows):
        tid = RESOURCES.index(resource) if resource in RESOURCES else len(RESOURCES)
        records.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": resource}})
        records.append({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": f"rank {rank}"}})
    payload = json.dumps({"traceEvents": records, "displayTimeUnit": "ms"}).encode()
    atomic_write(path, lambda stream: stream.write(payload))


def _colour(event: TimedEvent, stages: int):
    from matplotlib import colormaps

    if event.stage < 0:
        return "#bbbbbb"
    palette = colormaps["tab20"]
    sub = max(event.sub, 0)
    return palette((2 * event.stage + (sub % 2)) % 20 if stages <= 10 else event.stage % 20)


# What a block's label means, by its first letters (the simulator's and the executor's
# labels; a longer prefix before a shorter one it starts with); "^m" adds the micro-batch.
# Drawn under the picture for the letters it uses.
LABEL_LEGEND = (
    ("wait", "wait", "waiting for the rank's optimizer steps"),
    ("sync", "sync", "overflow and norm all-reduce (waits for every rank)"),
    ("fix", "fix", "deferred clipping corrections or rollbacks"),
    ("f", "fS", "forward of stage S"),
    ("b", "bS,k", "backward stage k of forward stage S"),
    ("p", "pS,k", "parameters prefetched to the GPU"), ("g", "gS,k", "gradients offloaded"),
    ("c", "cS,k", "activation checkpoint sent"), ("o", "oS,k", "CPU optimizer step"),
    ("u", "uS,k", "GPU optimizer update"), ("s", "sS,k", "optimizer states copied"),
    ("r", "rS,k", "optimizer states read (NVMe)"), ("w", "wS,k", "optimizer states written"),
    ("a", "aS", "activations sent"),
)


def legend_text(events: Iterable[TimedEvent]) -> str:
    """The notation of the labels these events use, in two lines."""
    used = {next((p for p, _, _ in LABEL_LEGEND if e.label.startswith(p)), None)
            for e in events}
    parts = [f"{form}: {meaning}" for p, form, meaning in LABEL_LEGEND if p in used]
    parts.append("^m: of micro-batch m")
    half = (len(parts) + 1) // 2
    return "labels:  " + ";  ".join(parts[:half]) + "\n" + ";  ".join(parts[half:])


def time_axis(end: float, unit: str) -> tuple[float, str]:
    """(scale, axis label) for times in `unit`: seconds drawn in ms below 10 s."""
    if unit == "s":
        return (1000.0, "time (ms)") if end < 10 else (1.0, "time (s)")
    return 1.0, f"time ({unit})"


def write_timeline_png(
    events: Sequence[TimedEvent], path: str, title: str = "", width: float = 14.0,
    time_unit: str = "s",
) -> None:
    """Draw the events as a Gantt chart: per rank a compute row and its other resources;
    `time_unit` is the events' (seconds are drawn in ms or s), a legend of the block
    labels below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    used = sorted({(e.rank, RESOURCES.index(e.resource) if e.resource in RESOURCES else 99,
                    e.resource) for e in events})
    rows = {(rank, resource): index for index, (rank, _, resource) in enumerate(used)}
    stages = max((e.stage for e in events), default=0) + 1
    scale, axis_label = time_axis(max((e.end for e in events), default=1.0), time_unit)
    end = max((e.end for e in events), default=1.0) * scale
    figure, axes = plt.subplots(figsize=(width, 0.45 * len(rows) + 1.8))
    try:
        for event in events:
            row = rows[(event.rank, event.resource)]
            start, duration = event.start * scale, (event.end - event.start) * scale
            axes.barh(row, duration, left=start, height=0.8,
                      color=_colour(event, stages), edgecolor="black", linewidth=0.4)
            text = event.label if event.mb < 0 else f"{event.label}^{event.mb}"
            if duration > end / 90:
                axes.text(start + duration / 2, row, text, ha="center", va="center",
                          fontsize=6, clip_on=True)
        axes.set_yticks(list(rows.values()))
        axes.set_yticklabels([f"GPU{rank} {resource}" if resource == "compute"
                              else f"  {resource}" for rank, resource in rows])
        axes.invert_yaxis()
        axes.set_xlim(0, end * 1.01)
        axes.set_xlabel(axis_label)
        if title:
            axes.set_title(title, fontsize=9)
        figure.tight_layout(rect=(0, 0.06, 1, 1))
        figure.text(0.01, 0.01, legend_text(events), fontsize=7, va="bottom")
        atomic_write(path, lambda stream: figure.savefig(stream, format="png", dpi=130))
    finally:
        plt.close(figure)


def read_chrome_trace(path: str, time_scale: float = 1e6) -> list[TimedEvent]:
    """The events `write_chrome_trace` wrote (times divided by `time_scale` again)."""
    with open(path, encoding="utf-8") as stream:
        records = json.load(stream)["traceEvents"]
    return [
        TimedEvent(
            rank=record["pid"],
            resource=RESOURCES[record["tid"]] if record["tid"] < len(RESOURCES) else "other",
            start=record["ts"] / time_scale,
            end=(record["ts"] + record["dur"]) / time_scale,
            label=record["name"], kind=record["cat"], **record["args"],
        )
        for record in records if record["ph"] == "X"
    ]
