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

from megatron.common.units import format_bytes
from megatron.config.run import DTYPE_BYTES, RunConfig, optimizer_state_bytes
from megatron.models.llama import Batch, LlamaConfig
from megatron.offload.naming import resolve_job_id
from megatron.offload.param_store import job_segments, sweep_dead_segments
from megatron.offload.shm import SegmentInUseError
from megatron.offload.shm_header import read_header
from megatron.offload.shm_space import DEFAULT_SHM_DIR
from megatron.pipeline.assembly import Pipeline
from megatron.pipeline.config import pipeline_config
from megatron.pipeline.host_group import host_group
from megatron.planning.shape import run_schedule
from megatron.schedules.cost_model import backward_stage_params, calibrated_costs, derived_costs
from megatron.schedules.hardware import HardwareProfile
from megatron.schedules.simulator import SimResult, simulate
from megatron.schedules.timeline import read_chrome_trace, write_chrome_trace, write_timeline_png
from megatron.training.checkpoint_state import OwnedState, named_tensors
from megatron.training.distributed import DistInfo
from megatron.training.fit_check import refuse_what_does_not_fit
from megatron.training.train_step import StepResult


def sweep_left_behind() -> None:
    """Remove the segments of dead processes (any run id: a job whose workers and reapers
    were killed leaves them) and say how much, once per node."""
    names, nbytes = sweep_dead_segments()
    if names:
        print(f"removed {len(names)} shared-memory segment(s) ({format_bytes(nbytes)}) "
              f"left by dead processes from {DEFAULT_SHM_DIR}", flush=True)


def live_job_with_this_id() -> SegmentInUseError | None:
    """Segments of this job id that survive the sweep belong to a live process: another
    job started with the same --rdzv-id. Found by each node's local rank 0 before any
    segment exists, so that the ranks stop together instead of each at its creation."""
    job_id = resolve_job_id()
    for name in job_segments(job_id):
        header = read_header(os.path.join(DEFAULT_SHM_DIR, name))
        if header is not None:
            return SegmentInUseError(
                f"shared-memory segment {DEFAULT_SHM_DIR}/{name} belongs to live process "
                f"{header['pid']}: another job with the same job id ({job_id}) is running "
                "on this node; give this job another --rdzv-id or stop the other one")
    return None


class PipelineTrainStep:
    def __init__(self, model_cfg: LlamaConfig, run: RunConfig, dist_info: DistInfo) -> None:
        self.rank = dist_info.rank
        self.model_cfg = model_cfg
        self.run = run
        schedule, report = run_schedule(run, dist_info.pipeline_size, model_cfg.vocab_size)
        self.config = pipeline_config(run, schedule, report)
        conflict = None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            # before the fit check, so that what dead runs left counts as free
            sweep_left_behind()
            if dist_info.world_size > 1:
                conflict = live_job_with_this_id()
        # every rank stops together, the one that found a problem says it
        refuse_what_does_not_fit(run, schedule, model_cfg.vocab_size,
                                 dist_info.layout.pipeline_rank, host_group(), conflict)
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
            "shared_memory_bytes_per_node")}

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


def step_backward_stage_params(step: PipelineTrainStep) -> dict:
    """Parameters per backward stage of `step`'s model and schedule."""
    schedule = step.config.schedule
    model = replace(step.run.model, vocab_size=step.model_cfg.vocab_size)
    return backward_stage_params(model, schedule.partition, schedule.backward_split)


def simulate_measured(step: PipelineTrainStep, trace_path: str, optimizer_s_per_param: float,
                      copy_s_per_byte: float) -> SimResult:
    """The simulator's prediction for `step`'s run, with a cost model calibrated from the
    iteration it traced (`--trace`) and the measured optimizer and copy rates."""
    schedule = step.config.schedule
    params = step_backward_stage_params(step)
    itemsize = step.run.precision.working_bytes
    costs = calibrated_costs(schedule, read_chrome_trace(trace_path), params, itemsize,
                             optimizer_s_per_param, copy_s_per_byte)
    return simulate(schedule, costs)


def simulate_from_profile(step: PipelineTrainStep, hardware: HardwareProfile) -> SimResult:
    """The simulator's prediction for `step`'s run priced from a hardware profile alone, as
    the planner prices a candidate (derived_costs of the run's model, schedule and
    micro-batch size, then simulate): nothing of the run's own timings is used."""
    schedule = step.config.schedule
    run = step.run
    model = replace(run.model, vocab_size=step.model_cfg.vocab_size)
    p = run.precision
    costs = derived_costs(schedule, model, hardware, run.training.micro_batch_size,
                          model.seq_length,
                          optimizer_state_bytes(DTYPE_BYTES[p.master_dtype],
                                                DTYPE_BYTES[p.optimizer_state_dtype]))
    return simulate(schedule, costs, step.config.report)
