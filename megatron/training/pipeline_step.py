"""The pipeline as the training loop's `TrainStep`: run configuration -> schedule ->
`PipelineConfig` -> `Pipeline`.

The schedule comes from megatron/planning/shape.py, the runtime's settings from
`pipeline_config`; this adapter refuses a run that does not fit, turns each iteration's
report into the loop's StepResult and writes the measured timeline files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch

from megatron.config.run import RunConfig
from megatron.models.llama import Batch, LlamaConfig
from megatron.pipeline.assembly import Pipeline
from megatron.pipeline.config import pipeline_config
from megatron.pipeline.host_group import host_group
from megatron.pipeline.node_memory import live_job_with_this_id, sweep_left_behind
from megatron.planning.shape import run_schedule
from megatron.schedules.timeline import write_chrome_trace, write_timeline_png
from megatron.training.checkpoint_state import OwnedState, named_tensors
from megatron.training.distributed import DistInfo
from megatron.training.fit_check import refuse_what_does_not_fit
from megatron.training.train_step import StepResult


class PipelineTrainStep:
    def __init__(self, model_cfg: LlamaConfig, run: RunConfig, dist_info: DistInfo) -> None:
        self.rank = dist_info.rank
        self.model_cfg = model_cfg
        self.run = run
        schedule, report = run_schedule(run, dist_info.pipeline_size, model_cfg.vocab_size)
        self.config = pipeline_config(run, schedule, report, dist_info.device)
        conflict = None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            # before the fit check, so that what dead runs left counts as free
            sweep_left_behind()
            if dist_info.world_size > 1:
                conflict = live_job_with_this_id()
        # every rank stops together, the one that found a problem says it
        headroom = refuse_what_does_not_fit(run, schedule, model_cfg.vocab_size,
                                            dist_info.layout.pipeline_rank, host_group(),
                                            conflict)
        self.config = replace(self.config, device_headroom_bytes=headroom)
        self.pipeline = Pipeline(self.config, model_cfg, self.rank)

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult:
        report = self.pipeline.step(iteration, micro_batches, lr, weight_decay)
        if report.events and self.rank == 0:
            self._write_timeline(report.events, report.breakdown.get("bubble_ratio"))
        r = report.result
        fp16 = self.config.dtype == torch.float16
        return StepResult(report.loss, skipped=r.skipped, grad_norm=r.grad_norm,
                          loss_scale=r.loss_scale if fp16 else None, extra=report.breakdown)

    def host_memory(self) -> dict:
        """What `format_host_memory` prints (also in every metrics record)."""
        return {k: self.pipeline.memory[k] for k in (
            "host_optimizer_state_bytes", "host_gradient_pool_bytes",
            "shared_memory_bytes_per_node", "pinned_bytes_per_process")}

    def evaluate(self, batches: Sequence[Sequence[Batch]]) -> float:
        return self.pipeline.evaluate(batches)

    def _write_timeline(self, events: list, bubble_ratio: float | None) -> None:
        s = self.config.schedule
        title = (f"measured: {s.name}, {s.ranks} ranks, {s.forward_stages} forward stages, "
                 f"d={s.backward_split}, {s.micro_batches} micro-batches"
                 + ("" if bubble_ratio is None else f"; bubble {bubble_ratio:.1%}"))
        png, trace = self.run.logging.timeline, self.run.logging.trace
        for path in (png, trace):  # checked writable at start, created only now
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if png:
            write_timeline_png(events, png, title=title)
        if trace:
            write_chrome_trace(events, trace)

    def owned_state(self) -> OwnedState:
        fp16 = self.config.dtype == torch.float16
        return OwnedState(named_tensors(self.model_cfg, self.pipeline.checkpoint_views()),
                          self.pipeline.optimizer_step(),
                          self.pipeline.scaler.state_dict() if fp16 else None,
                          self.pipeline.speculation())

    def restored(self, optimizer_step: int, loss_scaler: dict | None, iteration: int,
                 speculation: dict | None = None) -> None:
        if loss_scaler is not None and self.config.dtype == torch.float16:
            self.pipeline.scaler.load_state_dict(loss_scaler)
        self.pipeline.restored(optimizer_step, iteration, speculation)

    def close(self) -> None:
        self.pipeline.close()
