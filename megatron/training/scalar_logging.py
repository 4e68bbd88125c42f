"""TensorBoard (and W&B when asked for) scalars, under Megatron's names.

Megatron's names: `lm loss`, `learning-rate`, `loss-scale`, `grad-norm`, `batch-size`,
`lm loss validation` (and `lm loss validation ppl`, `lm loss test`, ...), each also
`... vs samples` against consumed samples, and `tokens-per-second`. As in Megatron, the
timers (`iteration-time` and this project's pipeline breakdown under `pipeline/`: gpu time,
bubble time, exposed optimizer time, bubble ratio, device memory peak) are written with
--log-timers-to-tensorboard, `throughput` (TFLOP/s per GPU) with --log-throughput. Only
the logging rank writes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

from megatron.config.errors import ConfigError
from megatron.config.run import RunConfig
from megatron.training.metrics import output_failed, warn_line

# metrics-record key -> scalar name (Megatron's where it has one)
TRAINING_SCALARS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "loss_scale": "loss-scale",
    "grad_norm": "grad-norm",
    "global_batch_size": "batch-size",
    "tokens_per_s": "tokens-per-second",
}
TIMER_SCALARS = {  # --log-timers-to-tensorboard
    "iter_time_s": "iteration-time",
    "gpu_time_s": "pipeline/gpu-time",
    "bubble_time_s": "pipeline/bubble-time",
    "exposed_optimizer_time_s": "pipeline/exposed-optimizer-time",
    "bubble_ratio": "pipeline/bubble-ratio",
    "device_memory_peak_bytes": "pipeline/device-memory-peak-bytes",
}
VS_SAMPLES = ("lm loss", "learning-rate", "lm loss validation")


def check_scalar_sinks(run: RunConfig) -> None:
    """Bad input before training: W&B asked for but not installed."""
    project = run.logging.wandb_project
    if project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project", project,
                          "needs the wandb package, which is not installed "
                          "(pip install wandb), or leave the flag out")


def _quiet_event_writer_thread() -> None:
    """TensorBoard's event writer thread re-raises its failure (a traceback on stderr) and
    hands it to the next call, which reports it in one line: keep only that line."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writer", False):
        return

    def hook(failure: threading.ExceptHookArgs) -> None:
        if type(failure.thread).__name__ != "_AsyncWriterThread":
            previous(failure)
    hook.quiets_event_writer = True
    threading.excepthook = hook


class ScalarSinks:
    """Where the scalars go: a SummaryWriter under --tensorboard-dir, a W&B run."""

    def __init__(self, run: RunConfig, enabled: bool) -> None:
        self._tensorboard = None
        self._wandb = None
        log = run.logging
        self._tensorboard_dir = log.tensorboard_dir
        self._interval = log.tensorboard_log_interval
        self._scalars = {**TRAINING_SCALARS,
                         **(TIMER_SCALARS if log.log_timers_to_tensorboard else {}),
                         **({"tflops_per_gpu": "throughput"} if log.log_throughput else {})}
        if not enabled:
            return
        if log.tensorboard_dir:
            # optional dependency: imported only when asked for
            from torch.utils.tensorboard import SummaryWriter

            _quiet_event_writer_thread()
            try:
                self._tensorboard = SummaryWriter(log_dir=log.tensorboard_dir,
                                                  max_queue=log.tensorboard_queue_size)
            except OSError as exc:
                warn_line(output_failed("--tensorboard-dir", log.tensorboard_dir, exc))
        if log.wandb_project:
            import wandb

            save_dir = log.wandb_save_dir or (
                os.path.join(run.checkpointing.save, "wandb") if run.checkpointing.save else None)
            if save_dir is not None:
                try:
                    os.makedirs(save_dir, exist_ok=True)
                except OSError as exc:  # an output that fails is said, training goes on
                    warn_line(output_failed("--wandb-save-dir", save_dir, exc))
                    save_dir = None
            entity = {"entity": log.wandb_entity} if log.wandb_entity else {}
            self._wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name,
                                     config=run.flags(), dir=save_dir, **entity)

    def training(self, record: dict) -> None:
        if record["iteration"] % self._interval:
            return  # --tensorboard-log-interval, as Megatron (W&B too)
        scalars = {name: record[key] for key, name in self._scalars.items()
                   if isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool)}
        self._write(scalars, record["iteration"], record.get("consumed_samples"))

    def evaluation(self, record: dict, consumed_samples: int) -> None:
        split = record["evaluation"]
        name = f"lm loss {split}"
        self._write({name: record["lm_loss"], f"{name} ppl": record["lm_loss_ppl"]},
                    record["iteration"], consumed_samples)

    def _write(self, scalars: dict, iteration: int, samples: int | None) -> None:
        if self._tensorboard is not None:
            try:  # the event writer's thread reports its failures at the next call
                for name, value in scalars.items():
                    self._tensorboard.add_scalar(name, value, iteration)
                    if samples is not None and name in VS_SAMPLES:
                        self._tensorboard.add_scalar(f"{name} vs samples", value, samples)
            except Exception as exc:  # noqa: BLE001 - any failure of an output stops it only
                self._tensorboard_failed(exc)
        if self._wandb is not None:
            self._wandb.log(scalars, step=iteration)

    def _tensorboard_failed(self, exc: BaseException) -> None:
        """A write that failed (a full disk, say) stops TensorBoard with one warning line;
        training goes on."""
        writer, self._tensorboard = self._tensorboard, None
        with contextlib.suppress(Exception):
            writer.close()
        warn_line(output_failed("--tensorboard-dir", self._tensorboard_dir, exc))

    def close(self) -> None:
        if self._tensorboard is not None:
            try:
                self._tensorboard.close()  # flushes: a late failure surfaces here
            except Exception as exc:  # noqa: BLE001
                self._tensorboard_failed(exc)
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
