"""The typed description of one pipeline run: everything the runtime needs, nothing else.

`megatron.training` builds it from the command-line flags and validates it; nothing below
training sees argparse. The schedule is the program every rank runs (generated, or read
from a schedule file), already validated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.schedules.instructions import BackwardStage, Schedule


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


@dataclass(frozen=True)
class SubgroupSettings:
    """Optimizer subgroups updated on the device (Deep Optimizer States) for the stages
    whose program says OPTIMIZER_START_SUBGROUPS."""

    stride: int | None  # every stride-th subgroup on the device; None: Eq. 1 (calibrated)
    size: int | None = None  # parameters per subgroup; None: from the largest such stage
    cache_dir: str = ""  # where the calibrated rates are cached (stride None)
    # > 0: the static baseline instead: this fraction of every owned stage's optimizer
    # state lives on the device and is always updated there (stride is then ignored)
    resident_fraction: float = 0.0


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling (fp16 only)."""

    initial_scale: float
    growth_interval: int
    min_scale: float


@dataclass(frozen=True)
class PipelineConfig:
    schedule: Schedule
    dtype: torch.dtype  # working parameters, gradients and messages
    micro_batch_size: int
    optimizer: OptimizerSettings
    loss_scaling: LossScaling | None = None  # fp16: dynamic; otherwise a constant 1
    procs_per_node: int | None = None  # None: the launcher's LOCAL_WORLD_SIZE
    inject_overflow: tuple[int, BackwardStage] | None = None  # testing: (iteration, stage)
    record_timeline_at: int | None = None  # the iteration whose events are gathered
    p2p_check: bool = False  # testing: a header with each tensor, checked on receipt
    subgroups: SubgroupSettings | None = None  # None: every update on the CPU
    # Replicas of the pipeline (world = ranks x data_parallel_size) and how they split
    # the host optimizer state (0: not at all, 1: states, 2: states and gradients).
    data_parallel_size: int = 1
    zero_stage: int = 0

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
