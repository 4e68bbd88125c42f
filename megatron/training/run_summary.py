"""The lines rank 0 prints when a run ends: what was trained, how the loss went, how long it
took and where every file the run wrote went (a newcomer's first question after a run)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from megatron.config.run import RunConfig
from megatron.pipeline.node_memory import PinningShortfall
from megatron.planning.run_plan import PARTS, PredictedIteration
from megatron.training.checkpointing import iteration_dir
from megatron.training.metrics import format_duration


@dataclass
class RunOutcome:
    """What the loop knows at the end: its per-iteration records (this run's only), the
    iteration it resumed from, why it stopped early (None: it ran to --train-iters), the
    last iteration it saved, the seconds since the run started, whether it recorded a
    timeline (only a pipeline does), the memory it could not page-lock, and its plan's
    predicted iteration."""

    records: list[dict]
    start_iteration: int
    stopped: str | None
    last_saved: int | None
    elapsed_s: float
    pipeline: bool
    pinning: PinningShortfall | None = None  # page-locked memory the limit did not allow
    prediction: PredictedIteration | None = None  # the run's plan's, on --hardware's profile


PART_NAMES = dict(zip(PARTS, ("compute", "bubbles", "exposed optimizer")))


def format_run_summary(run: RunConfig, outcome: RunOutcome) -> str:
    """A headline, the plan's prediction beside the measured iteration, one line per output
    (only the outputs this run was asked for), and what slowed the whole run down
    (page-locked memory over its limit)."""
    slowed = [outcome.pinning.summary_line()] if outcome.pinning is not None else []
    return "\n".join([_headline(run, outcome), *_plan_check(outcome), *_outputs(run, outcome),
                      *slowed])


def _plan_check(outcome: RunOutcome) -> list[str]:
    """The plan's predicted iteration beside the measured one (the median of this run's
    iterations, the first left out as a warm-up when there are others), their ratio, and
    the part of the iteration the prediction misses most (medians of the measured parts:
    one slow iteration does not name a part)."""
    prediction, records = outcome.prediction, outcome.records
    if prediction is None or not records:
        return []
    measured = records[1:] or records
    median = statistics.median(r["iter_time_s"] for r in measured)
    parts = {name: (value, statistics.median(r[name] for r in measured))
             for name, value in prediction.parts().items()}
    name, (predicted, seen) = max(parts.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
    return [f"  plan:        predicted iteration {prediction.iteration_s:.3f} s "
            f"({prediction.hardware}), measured {median:.3f} s (the median of iterations "
            f"{measured[0]['iteration']}-{measured[-1]['iteration']}): predicted/measured "
            f"{prediction.iteration_s / median:.2f}; off the most: {PART_NAMES[name]}, "
            f"{predicted:.3f} s predicted, {seen:.3f} s measured"]


def _headline(run: RunConfig, outcome: RunOutcome) -> str:
    records, train_iters = outcome.records, run.training.train_iters
    took = f"{outcome.elapsed_s:.1f} s" if outcome.elapsed_s < 60 \
        else format_duration(outcome.elapsed_s)
    if not records:
        return (f"run summary: no iteration to train (resumed at iteration "
                f"{outcome.start_iteration} of {train_iters}), {took}")
    first, last = records[0]["iteration"], records[-1]["iteration"]
    training_s = sum(r["iter_time_s"] for r in records)
    losses = [(r["loss"], r["iteration"]) for r in records
              if not r.get("skipped") and math.isfinite(r["loss"])]
    end = "" if outcome.stopped is None else f", stopped early: {outcome.stopped}"
    line = (f"run summary: iterations {first}-{last} of {train_iters}, {took} from set-up "
            f"to the end ({training_s:.1f} s of it in iterations)")
    if losses:
        best, at = min(losses)
        line += f"; final lm loss {losses[-1][0]:.6E}, best {best:.6E} at iteration {at}"
    skipped = records[-1].get("skipped_total", 0)
    if skipped:
        line += f"; {skipped} skipped iterations"
    return line + end


def _outputs(run: RunConfig, outcome: RunOutcome) -> list[str]:
    logging, save = run.logging, run.checkpointing.save
    last = outcome.records[-1]["iteration"] if outcome.records else None
    not_recorded = "not written: one process runs no pipeline to record"
    rows = [("metrics", logging.metrics_file, "one JSON object per iteration"),
            ("timeline", logging.timeline, f"the measured iteration {last}"
             if outcome.pipeline else not_recorded),
            ("trace", logging.trace, "the same iteration, for chrome://tracing or Perfetto"
             if outcome.pipeline else not_recorded),
            ("tensorboard", logging.tensorboard_dir, "scalars under Megatron's names")]
    if save and outcome.last_saved is not None:
        rows.append(("checkpoint", iteration_dir(save, outcome.last_saved),
                     f"the latest in {save}; resume with --load {save}"))
    elif save:
        rows.append(("checkpoint", save, "none written by this run"))
    lines = [f"  {name + ':':<13}{path} ({what})" for name, path, what in rows if path]
    return lines or ["  no output files (--metrics-file, --timeline, --trace, --save, "
                     "--tensorboard-dir write them)"]
