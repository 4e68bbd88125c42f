"""What the training loop asks of one iteration, whoever runs it: `TrainStep` and its result.

`LocalTrainStep` (one process) and `PipelineTrainStep` (the pipeline runtime) implement it.
Both receive their micro-batches already on the process's device: the loop places them
once (`on_device`), for training and evaluation alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron.models.llama import Batch
from megatron.training.checkpoint_state import OwnedState


@dataclass
class StepResult:
    loss: float
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None
    extra: dict = field(default_factory=dict)  # e.g. the pipeline's time breakdown


def on_device(micro_batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    """The micro-batches on `device` (the device decision's), for any train step."""
    return [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in micro_batches]


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
