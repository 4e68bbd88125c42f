"""Learning rate and weight decay per iteration, from megatron-core's OptimizerParamScheduler.

The scheduler only needs an object with `param_groups`; we give it one group and read the
values back, so the same schedule drives torch's AdamW in one process and the per-stage CPU
optimizers of a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _ParamGroupsHolder:
    param_groups: list[dict]


class LRSchedule:
    def __init__(
        self,
        lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
        weight_decay: float,
    ) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self._holder = _ParamGroupsHolder([{"lr": 0.0, "weight_decay": weight_decay}])
        self._scheduler = OptimizerParamScheduler(
            self._holder,
            init_lr=0.0,
            max_lr=lr,
            min_lr=min_lr,
            lr_warmup_steps=warmup_iters,
            lr_decay_steps=max(decay_iters, warmup_iters + 1),
            lr_decay_style=decay_style,
            start_wd=weight_decay,
            end_wd=weight_decay,
            wd_incr_steps=max(decay_iters, 1),
            wd_incr_style="constant",
        )

    @property
    def lr(self) -> float:
        return float(self._holder.param_groups[0]["lr"])

    @property
    def weight_decay(self) -> float:
        return float(self._holder.param_groups[0]["weight_decay"])

    @property
    def num_steps(self) -> int:
        return int(self._scheduler.num_steps)

    def step(self) -> None:
        """Advance one iteration (after the optimizer step, as Megatron does)."""
        self._scheduler.step(increment=1)

    def state_dict(self) -> dict:
        return self._scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._scheduler.load_state_dict(state)
        self._scheduler.step(increment=0)  # refresh lr/wd for the restored step count
