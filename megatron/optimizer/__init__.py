"""CPU optimizer of the GPU-CPU pipeline (S 3.2): the C++ AdamW kernel's Python layer over
optimizer groups, per-group asynchronous tasks, loss scaling, post-step validation and
rollback."""

from megatron.optimizer.cpu_adam import (
    CPUAdamW,
    GroupStepResult,
    available_isas,
    check_gradient,
    kernel_tuning,
    kernel_tuning_setting,
)
from megatron.optimizer.group_optimizer import AsyncGroupOptimizer, IterationResult
from megatron.optimizer.group_tasks import GroupTaskError, GroupTaskRunner
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler

__all__ = [
    "AsyncGroupOptimizer",
    "CPUAdamW",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "GroupStepResult",
    "GroupTaskError",
    "GroupTaskRunner",
    "IterationResult",
    "LossScaler",
    "available_isas",
    "check_gradient",
    "kernel_tuning",
    "kernel_tuning_setting",
]
