"""Learning rate and weight decay per iteration, from megatron-core's OptimizerParamScheduler.

The scheduler only needs an object with `param_groups`; we give it one group and read the
values back, so the same schedule drives torch's AdamW in one process and the per-stage CPU
optimizers of a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.run import RunConfig

# The scheduler's settings a checkpoint carries, by what sets them here (steps count samples)
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "warmup samples",
    "lr_decay_steps": "decay samples",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "start weight decay",
    "end_wd": "end weight decay",
    "wd_incr_steps": "weight decay samples",
    "wd_incr_style": "--weight-decay-incr-style",
}


@dataclass
class _ParamGroupsHolder:
    param_groups: list[dict]


class LRSchedule:
    """The learning rate and weight decay of each iteration. Steps count samples, as
    Megatron's do (an iteration advances by the global batch), so a scheduler state saved by
    Megatron-LM means the same here."""

    def __init__(self, run: RunConfig) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = run.optimization
        self.samples_per_iteration, warmup, decay, wsd = run.lr_schedule_steps
        self._holder = _ParamGroupsHolder([{"lr": 0.0, "weight_decay": o.weight_decay}])
        self._scheduler = OptimizerParamScheduler(
            self._holder,
            init_lr=o.lr_warmup_init,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=decay,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay if o.start_weight_decay is None else o.start_weight_decay,
            end_wd=o.weight_decay if o.end_weight_decay is None else o.end_weight_decay,
            wd_incr_steps=max(run.training_samples, 1),
            wd_incr_style=o.weight_decay_incr_style,
            wsd_decay_steps=wsd,
            lr_wsd_decay_style=o.lr_wsd_decay_style,
            # a resume continues the checkpoint's schedule unless this run's is asked for
            use_checkpoint_opt_param_scheduler=not o.override_opt_param_scheduler,
            override_opt_param_scheduler=o.override_opt_param_scheduler,
        )

    @property
    def lr(self) -> float:
        return float(self._holder.param_groups[0]["lr"])

    @property
    def weight_decay(self) -> float:
        return float(self._holder.param_groups[0]["weight_decay"])

    @property
    def num_steps(self) -> int:
        """Samples consumed so far."""
        return int(self._scheduler.num_steps)

    def step(self) -> None:
        """Advance one iteration (after the optimizer step, as Megatron does)."""
        self._scheduler.step(increment=self.samples_per_iteration)

    def state_dict(self) -> dict:
        return self._scheduler.state_dict()

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue from `state`; returns what of it differs from this run's flags (kept,
        unless --override-opt_param-scheduler), in words: [] when nothing differs."""
        ours = {attr: getattr(self._scheduler, attr) for attr in SCHEDULE_FLAGS}
        self._scheduler.load_state_dict(state)
        self._scheduler.step(increment=0)  # refresh lr/wd for the restored step count
        return [f"{what} {getattr(self._scheduler, attr)} (this run's: {ours[attr]})"
                for attr, what in SCHEDULE_FLAGS.items()
                if getattr(self._scheduler, attr) != ours[attr]]
