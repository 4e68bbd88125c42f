"""Megatron-like log lines and the machine-readable metrics file (one JSON object per line)."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from megatron.common.units import format_bytes


def format_tflops(tflops: float) -> str:
    """Megatron's one decimal where that shows the figure; 3 significant digits below 1
    (a CPU process does well under 0.05 TFLOP/s, which one decimal would print as 0.0)."""
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


# the pipeline's times of an iteration that the line prints, averaged over its interval
INTERVAL_TIMES = ("gpu_time_s", "bubble_time_s", "exposed_optimizer_time_s")


class LogInterval:
    """The iterations since the previous iteration line, reduced as Megatron-LM 0.19's
    training_log reduces them: the mean loss of the iterations that updated (a skipped
    one's loss left out; an interval with none prints 0, and no loss at all before the
    run's first update), the wall time per iteration (evaluations and checkpoint saves
    left out, as its interval timer stops for them), the skipped iterations and those of
    them whose loss was not finite. The other fields of a line are its last iteration's."""

    def __init__(self) -> None:
        self.clear()
        self.updated_once = False

    def clear(self) -> None:
        self.iterations = self.updated = self.skipped = self.nan = 0
        self.loss_sum = self.seconds = 0.0
        self.times = dict.fromkeys(INTERVAL_TIMES, 0.0)

    def add(self, record: dict[str, Any], seconds: float) -> None:
        """One iteration's metrics record and its wall time."""
        self.iterations += 1
        self.seconds += seconds
        if record["skipped"]:
            self.skipped += 1
            self.nan += not math.isfinite(record["loss"])
        else:
            self.updated += 1
            self.updated_once = True
            self.loss_sum += record["loss"]
        for key in INTERVAL_TIMES:
            if record.get(key) is not None:
                self.times[key] += record[key]

    @property
    def seconds_per_iteration(self) -> float:
        return self.seconds / self.iterations

    def fields(self) -> dict[str, Any]:
        """What the line takes from the interval, under the metrics records' names."""
        return {"loss": self.loss_sum / max(1, self.updated) if self.updated_once else None,
                "skipped_iterations": self.skipped, "nan_iterations": self.nan,
                **{key: total / self.iterations for key, total in self.times.items()
                   if total}}


def format_log_line(m: dict[str, Any], train_iters: int, throughput: bool = False) -> str:
    """Megatron's iteration line of a record whose loss, times, rates and counts are its
    interval's (LogInterval); `throughput` (--log-throughput) adds the model TFLOP/s per
    GPU."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    parts = [
        f" [{stamp}] iteration {m['iteration']:>8d}/{train_iters:>8d}",
        f"consumed samples: {m['consumed_samples']:>12d}",
        f"elapsed time per iteration (ms): {m['iter_time_s'] * 1000:.1f}",
        *([f"throughput per GPU (TFLOP/s/GPU): {format_tflops(m['tflops_per_gpu'])}"]
          if throughput else []),
        f"tokens per second: {m['tokens_per_s']:.0f}",
        f"learning rate: {m['lr']:.6E}",
        f"global batch size: {m['global_batch_size']:>5d}",
    ]
    if m.get("loss") is not None:
        parts.append(f"lm loss: {m['loss']:.6E}")
    # Megatron prints the scale of every precision (1.0 without fp16's scaler)
    parts.append(f"loss scale: {m['loss_scale'] if m.get('loss_scale') else 1.0:.1f}")
    if m.get("grad_norm") is not None and math.isfinite(m["grad_norm"]):
        parts.append(f"grad norm: {m['grad_norm']:.3f}")
    parts.append(f"number of skipped iterations: {m['skipped_iterations']:>3d}")
    parts.append(f"number of nan iterations: {m['nan_iterations']:>3d}")
    if m.get("eta_s") is not None:
        parts.append(f"eta: {format_duration(m['eta_s'])}")
    for key, label in (("gpu_time_s", "gpu time (ms)"), ("bubble_time_s", "bubble time (ms)"),
                       ("exposed_optimizer_time_s", "exposed optimizer time (ms)")):
        if m.get(key) is not None:
            parts.append(f"{label}: {m[key] * 1000:.1f}")
    return " | ".join(parts) + " |"


def format_host_memory(m: dict[str, Any]) -> str:
    """The start-up line on host memory (the metrics fields of the same names)."""
    return (f"host memory per process: optimizer state (master, exp_avg, exp_avg_sq) "
            f"{format_bytes(m['host_optimizer_state_bytes'])}, gradient pool "
            f"{format_bytes(m['host_gradient_pool_bytes'])}; parameters in shared memory per "
            f"node {format_bytes(m['shared_memory_bytes_per_node'])} (the largest process, "
            f"the largest node)")


def format_duration(seconds: float) -> str:
    """H:MM:SS (days as hours)."""
    whole = max(0, int(round(seconds)))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class MetricsWriter:
    """Appends one JSON object per iteration; flushed each line so a crash loses nothing.
    A write that fails (a full disk, a file system gone read-only) stops the metrics with
    one warning line; training goes on (the metrics are an output, not the run's state)."""

    def __init__(self, path: str | None, warn: Callable[[str], object] | None = None) -> None:
        self._file: TextIO | None = None
        self.path, self._warn = path, warn or warn_line
        if path:
            try:
                parent = os.path.dirname(os.path.abspath(path))
                os.makedirs(parent, exist_ok=True)
                self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                self._failed(exc)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self._close_quietly()
        self._warn(output_failed("--metrics-file", self.path, exc))

    def _close_quietly(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # what was not flushed fails again
                file.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._file = None
                self._warn(output_failed("--metrics-file", self.path, exc))
            self._file = None


def warn_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def output_failed(flag: str, path: str | None, exc: BaseException) -> str:
    """The one warning line of an output that stopped writing."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
    return (f"pretrain_llama.py: warning: {flag} {path}: writing failed ({reason}); nothing "
            "more is written there, training goes on")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
