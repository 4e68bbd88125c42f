"""CPU optimizer of the GPU-CPU pipeline (S 3.2): the C++ AdamW kernel's Python layer,
per-stage asynchronous tasks, loss scaling, post-step validation and rollback."""

from megatron.optimizer.async_optimizer import AsyncStageOptimizer, IterationResult
from megatron.optimizer.cpu_adam import CPUAdamW, StageStepResult, available_isas, check_gradient
from megatron.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from megatron.optimizer.stage_tasks import StageTaskError, StageTaskRunner

__all__ = [
    "AsyncStageOptimizer",
    "CPUAdamW",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "IterationResult",
    "LossScaler",
    "StageStepResult",
    "StageTaskError",
    "StageTaskRunner",
    "available_isas",
    "check_gradient",
]
