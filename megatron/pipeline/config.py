"""What the pipeline runtime needs of a run, resolved for this process: the validated
schedule every rank runs, torch dtypes, thread counts, the optimizer's settings.

`pipeline_config` projects it from the run's plan (megatron/planning/run_plan.py: the
schedule and its validation, the optimizer's resolved placement) and the run
configuration (hyper-parameters, dtypes, testing switches): the pipeline runs exactly the
plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron.config.device_choice import DeviceChoice
from megatron.config.placement import DEFAULT_PLACEMENT, Placement
from megatron.config.run import PrecisionConfig, RunConfig
from megatron.optimizer.cpu_adam import usable_cores
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from megatron.planning.run_plan import RunPlan
from megatron.schedules.instructions import BackwardStage, Schedule
from megatron.schedules.validator import ValidationReport

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OptimizerSettings:
    """CPU AdamW hyper-parameters at start (lr and weight decay follow the LR schedule)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float  # 0 disables clipping by the global norm
    threads: int  # kernel threads of this process's CPU AdamW
    state_dtype: torch.dtype = torch.float32  # m and v: float32 or bfloat16
    master_dtype: torch.dtype = torch.float32  # master weights: float32 or bfloat16
    stochastic_rounding: bool = True  # a bf16 master rounds stochastically (else nearest)
    seed: int = 0  # keys the stochastic rounding's random bits
    exact_rollback: bool = False  # host states: snapshot each step (bit-exact rollbacks)


@dataclass(frozen=True)
class LossScaling:
    """fp16's loss scaling: static (--loss-scale) or dynamic."""

    static_scale: float | None
    initial_scale: float
    growth_interval: int
    min_scale: float
    hysteresis: int

    @classmethod
    def of(cls, p: PrecisionConfig) -> LossScaling | None:
        """The run's loss scaling; None (a constant 1) unless the working dtype is fp16."""
        if p.dtype != "fp16":
            return None
        return cls(p.loss_scale, p.initial_loss_scale, p.loss_scale_window, p.min_loss_scale,
                   p.hysteresis)

    def build(self) -> LossScaler:
        if self.static_scale is not None:
            return ConstantLossScaler(self.static_scale)
        return DynamicLossScaler(self.initial_scale, growth_interval=self.growth_interval,
                                 min_scale=self.min_scale, hysteresis=self.hysteresis)


@dataclass(frozen=True)
class PipelineConfig:
    schedule: Schedule
    report: ValidationReport  # the schedule's validation (residency bounds size the buffers)
    dtype: torch.dtype  # working parameters, each micro-batch's gradients and messages
    micro_batch_size: int
    optimizer: OptimizerSettings
    loss_scaling: LossScaling | None = None  # fp16: dynamic; otherwise a constant 1
    procs_per_node: int | None = None  # None: the launcher's LOCAL_WORLD_SIZE
    inject_overflow: tuple[int, BackwardStage] | None = None  # testing: (iteration, stage)
    record_timeline_at: int | None = None  # the iteration whose events are gathered
    p2p_check: bool = False  # testing: a header with each tensor, checked on receipt
    # where the optimizer's updates run and its states live, as the plan resolved it (the
    # assembly executes it; a split still to choose is not one it can run)
    placement: Placement = DEFAULT_PLACEMENT
    device_sanitizer: bool = False  # check the device layer's stream order
    device_chaos: int | None = None  # a seed: delay the copy streams at random
    # Replicas of the pipeline (world = ranks x data_parallel_size) and how they split
    # the host optimizer state (0: not at all, 1: states, 2: states and gradients).
    data_parallel_size: int = 1
    zero_stage: int = 0
    device: DeviceChoice | None = None  # the process's device decision; None: the machine's
    # the main gradients' dtype (megatron.config.run.host_gradient_dtype); None: the
    # working dtype's without Megatron-LM's flags
    host_gradient_dtype: torch.dtype | None = None

    @property
    def ranks(self) -> int:
        return self.schedule.ranks

    @property
    def forward_stages(self) -> int:
        return self.schedule.forward_stages

    @property
    def backward_split(self) -> int:
        return self.schedule.backward_split

    @property
    def micro_batches(self) -> int:
        return self.schedule.micro_batches

    @property
    def partition(self) -> tuple[int, ...]:
        return self.schedule.partition


def working_dtype(precision: PrecisionConfig) -> torch.dtype:
    """Parameters, each micro-batch's gradients and messages: fp32, bf16 or fp16."""
    return TORCH_DTYPES[precision.dtype]


def optimizer_threads(run: RunConfig) -> int:
    """This process's CPU AdamW threads: --cpu-optimizer-threads, or its share of the cores
    it may run on (affinity respected) among its node's processes."""
    local_procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return run.cpu_optimizer.cpu_optimizer_threads or max(1, len(usable_cores()) // local_procs)


def pipeline_config(run: RunConfig, plan: RunPlan,
                    device: DeviceChoice | None = None) -> PipelineConfig:
    """The runtime's view of `run` executing `plan` (its schedule, validated, and its
    resolved placement) in this process, on `device` (the process's device decision)."""
    o, p, c = run.optimization, run.precision, run.cpu_optimizer
    dtype = working_dtype(p)
    threads = optimizer_threads(run)
    inject = None
    if run.testing.inject_overflow is not None:
        iteration, stage, sub = run.testing.inject_overflow
        inject = (iteration, BackwardStage(stage, sub))
    logging = run.logging
    return PipelineConfig(
        schedule=plan.schedule,
        report=plan.report,
        dtype=dtype,
        micro_batch_size=run.training.micro_batch_size,
        optimizer=OptimizerSettings(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                    weight_decay=o.weight_decay, clip_grad=o.clip_grad,
                                    threads=threads,
                                    state_dtype=TORCH_DTYPES[p.optimizer_state_dtype],
                                    master_dtype=TORCH_DTYPES[p.master_dtype],
                                    stochastic_rounding=p.master_rounding == "stochastic",
                                    seed=run.training.seed,
                                    exact_rollback=c.optimizer_exact_rollback),
        loss_scaling=LossScaling.of(p),
        procs_per_node=run.parallel.procs_per_node,
        inject_overflow=inject,
        record_timeline_at=(run.training.train_iters if logging.timeline or logging.trace
                            else None),
        p2p_check=run.testing.p2p_check,
        device_sanitizer=run.device_checks.device_sanitizer,
        device_chaos=run.device_checks.device_chaos,
        placement=plan.placement,
        data_parallel_size=run.data_parallel_size,
        zero_stage=run.parallel.zero_stage,
        device=device,
        # the dtype the plan priced the main gradients in
        host_gradient_dtype=TORCH_DTYPES[p.host_gradient_dtype],
    )
