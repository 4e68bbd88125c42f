"""What the training loop asks of one iteration, whoever runs it: `TrainStep` and its result.

`LocalTrainStep` (one process) and `PipelineTrainStep` (the pipeline runtime) implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatron.models.llama import Batch
from megatron.training.checkpoint_state import OwnedState


@dataclass
class StepResult:
    loss: float
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None
    extra: dict = field(default_factory=dict)  # e.g. the pipeline's time breakdown


class TrainStep(Protocol):
    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult: ...

    def evaluate(self, batches: Sequence[Sequence[Batch]]) -> float:
        """Mean loss over every micro-batch (one list per evaluation iteration), forward
        only, on the parameters of the last finished iteration."""
        ...

    def owned_state(self) -> OwnedState: ...

    def restored(self, optimizer_step: int, loss_scaler: dict | None, iteration: int,
                 speculation: dict | None = None) -> None: ...
