"""The pipeline as the training loop's `TrainStep`: run configuration -> the run's plan ->
`PipelineConfig` -> `Pipeline`.

The plan (megatron/planning/run_plan.py) is built once per rank: the schedule and its
validation (megatron/planning/shape.py), its memory held against what is free now (the
fit check refuses a run that does not fit), the optimizer's placement resolved in the
device memory left, the prediction on --hardware's profile. The runtime's settings are
its projection (`pipeline_config`). This adapter also turns each iteration's report into
the loop's StepResult and writes the measured timeline files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from megatron.common.files import make_parent_dir
from megatron.config.run import RunConfig
from megatron.models.llama import Batch, LlamaConfig
from megatron.pipeline.assembly import Pipeline
from megatron.pipeline.config import optimizer_threads, pipeline_config
from megatron.pipeline.node_memory import (
    live_job_with_this_id,
    resolve_procs_per_node,
    sweep_left_behind,
)
from megatron.pipeline.optimizer_calibration import update_rates_here
from megatron.planning.evaluate import run_hardware
from megatron.planning.report import describe
from megatron.planning.run_plan import Capacity, RunPlan, resolved_plan, run_start
from megatron.schedules.optimizer_stride import UpdateRates
from megatron.schedules.timeline import write_chrome_trace, write_timeline_png
from megatron.training.checkpoint_state import OwnedState, named_tensors
from megatron.training.distributed import DistInfo
from megatron.training.fit_check import free_memory, refuse_what_does_not_fit
from megatron.training.train_step import StepResult


class PipelineTrainStep:
    def __init__(self, model_cfg: LlamaConfig, run: RunConfig, dist_info: DistInfo) -> None:
        self.rank = dist_info.rank
        self.model_cfg = model_cfg
        self.run = run
        self.plan = plan_the_run(run, model_cfg.vocab_size, dist_info)
        if self.rank == 0:
            print(describe(run.evolve(model={"vocab_size": model_cfg.vocab_size}), self.plan),
                  flush=True)
        elif self.plan.split_note:  # each rank resolves its own split
            print(f"rank {self.plan.rank}: {self.plan.split_note}", flush=True)
        self.config = pipeline_config(run, self.plan, dist_info.device)
        self.pipeline = Pipeline(self.config, model_cfg, self.rank)

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult:
        report = self.pipeline.step(iteration, micro_batches, lr, weight_decay)
        if report.events and self.rank == 0:
            self._write_timeline(report.events, report.breakdown.get("bubble_ratio"))
        r = report.result
        fp16 = self.config.dtype == torch.float16
        prediction = self.plan.prediction  # beside what was measured, in every record
        extra = report.breakdown | (prediction.fields() if prediction is not None else {})
        return StepResult(report.loss, skipped=r.skipped, grad_norm=r.grad_norm,
                          loss_scale=r.loss_scale if fp16 else None, extra=extra)

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
        if png:
            make_parent_dir(png)
            write_timeline_png(events, png, title=title)
        if trace:
            make_parent_dir(trace)
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


def plan_the_run(run: RunConfig, vocab_size: int, dist_info: DistInfo) -> RunPlan:
    """This rank's plan of `run` (see the module docstring), before anything of the
    pipeline exists. Raises ConfigError (ResourceError) on every rank when one cannot start."""
    run = run.evolve(model={"vocab_size": vocab_size})
    conflict = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # before the fit check, so that what dead runs left counts as free
        sweep_left_behind()
        if dist_info.world_size > 1:
            conflict = live_job_with_this_id()
    free = free_memory()
    # the memory model's view with data parallelism: one pipeline whose nodes hold the
    # replicas' processes (with ZeRO they hold a pipeline rank's state once between them)
    procs = max(1, resolve_procs_per_node(run.parallel.procs_per_node)
                // run.data_parallel_size)
    hardware = run_hardware(run)
    start = run_start(run, dist_info.pipeline_size, procs, not free.device_in_host, hardware)
    rank = dist_info.layout.pipeline_rank
    # every rank stops together, the one that found a problem says it
    headroom = refuse_what_does_not_fit(start.memory, run, rank, free, conflict)

    def rates(subgroup: int) -> UpdateRates:
        return update_rates_here(dist_info.device, optimizer_threads(run),
                                 run.data.data_cache_dir, subgroup=subgroup,
                                 log=lambda line: print(f"rank {rank}: {line}", flush=True))
    return resolved_plan(run, start, {rank: headroom}, rates, hardware, Capacity.of_free(free),
                         rank)
