"""One optimizer step per iteration over all backward stages, in one of two schedules:

- "async" (SysX, S 3.2 and Fig. 7b): each stage's step starts as soon as its gradient
  has landed, validates that stage's gradient locally and updates if it is finite; after
  all stages, one all-reduce of the overflow flags; if any stage on any rank overflowed,
  every stage that updated rolls back and the iteration counts as skipped.
- "sync" (Mobius, Megatron; Fig. 7a): every stage's gradient is checked as it lands;
  after all stages, one all-reduce decides; then all stages update (or none).

`post_validation_after=N` runs "sync" until N clean iterations in a row, then "async"
(the SysX paper saw all its rollbacks in the first iterations, with a high initial scale).

Gradient clipping by the global norm (`clip_grad > 0`): the norm comes from the sum of
squares computed in the same pass as the check. In "sync" the clip factor is folded into
the unscaling of the update. In "async" the stages have already updated when the norm is
known: if it exceeds `clip_grad`, every stage rolls back and steps again with the clip
factor, which costs a second pass only in the iterations that clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.optimizer.cpu_adam import CPUAdamW, check_gradient
from megatron.optimizer.loss_scaler import LossScaler
from megatron.optimizer.stage_tasks import ReadySignal, StageTaskError, StageTaskRunner

MODES = ("async", "sync")


@dataclass(frozen=True)
class IterationResult:
    skipped: bool  # an overflow somewhere: no stage changed this iteration
    mode: str  # the schedule this iteration ran with
    loss_scale: float  # the scale the gradients were computed with
    grad_norm: float  # global norm of the unscaled gradient (inf on overflow)
    overflow_stages: tuple[int, ...]  # local stages whose gradient was not finite
    rolled_back_stages: tuple[int, ...]  # local stages that updated, then rolled back
    clipped: bool  # the update used a clip factor < 1


@dataclass
class _Submission:
    grad: torch.Tensor
    out: torch.Tensor | None


class AsyncStageOptimizer:
    """Drives CPUAdamW once per iteration: submit() each stage as its backward finishes,
    then finish_iteration() after the last one."""

    def __init__(
        self,
        optimizer: CPUAdamW,
        scaler: LossScaler,
        *,
        mode: str = "async",
        post_validation_after: int = 0,
        clip_grad: float = 0.0,
        max_workers: int = 2,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        if post_validation_after < 0:
            raise ValueError(f"post_validation_after={post_validation_after} must be >= 0")
        if clip_grad < 0.0:
            raise ValueError(f"clip_grad={clip_grad} must be >= 0 (0 disables clipping)")
        self.optimizer = optimizer
        self.scaler = scaler
        self.mode = mode
        self.post_validation_after = int(post_validation_after)
        self.clip_grad = float(clip_grad)
        self.process_group = process_group
        self.runner = StageTaskRunner(max_workers=max_workers)
        self._clean_in_a_row = 0
        self._submitted: dict[int, _Submission] = {}
        self._iteration_mode: str | None = None
        self._iteration_scale: float | None = None

    def current_mode(self) -> str:
        """The schedule the next (or current) iteration runs with."""
        if self._iteration_mode is not None:
            return self._iteration_mode
        if self.mode == "async" and self._clean_in_a_row < self.post_validation_after:
            return "sync"
        return self.mode

    def submit(
        self,
        stage: int,
        grad: torch.Tensor,
        ready: ReadySignal = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Schedule stage's step: it starts once `ready` says the gradient has landed.
        `grad` and `out` must stay untouched until finish_iteration() returns."""
        if stage in self._submitted:
            raise ValueError(f"stage {stage} was already submitted in this iteration")
        self.optimizer.check_inputs(stage, grad, out)  # fail here, not in a task
        if self._iteration_mode is None:
            self._iteration_mode = self.current_mode()
            self._iteration_scale = self.scaler.scale
        self._submitted[stage] = _Submission(grad, out)
        inv_scale = 1.0 / self._iteration_scale
        if self._iteration_mode == "async":
            def task() -> tuple[bool, float]:
                result = self.optimizer.step_stage(stage, grad, inv_scale=inv_scale, out=out)
                return result.updated, result.grad_sq_sum
        else:
            adam = self.optimizer

            def task() -> tuple[bool, float]:
                return check_gradient(grad, inv_scale, adam.threads, adam.isa, adam.cores)

        self.runner.submit(stage, task, ready)

    def finish_iteration(self) -> IterationResult:
        """Waits for every stage, synchronizes the flags across ranks, rolls back or
        updates, and adjusts the loss scale."""
        mode = self._iteration_mode or self.current_mode()
        scale = self._iteration_scale or self.scaler.scale
        submitted = self._submitted
        try:
            checks = self._wait_all_or_undo()
            overflow_stages = tuple(s for s, (finite, _) in sorted(checks.items()) if not finite)
            local_sq = sum(sq for finite, sq in checks.values() if finite)
            overflow, global_sq = self._all_reduce(len(overflow_stages) > 0, local_sq)
            grad_norm = math.inf if overflow else math.sqrt(global_sq)
            clip = self._clip_factor(grad_norm)
            rolled_back: tuple[int, ...] = ()
            if mode == "async" and (overflow or clip < 1.0):
                rolled_back = self._roll_back_updated(checks)
            if not overflow and (mode == "sync" or clip < 1.0):
                self._update_all(submitted, 1.0 / scale * clip)
            for stage in submitted:
                self.optimizer.commit_stage(stage)
        finally:
            self._submitted = {}
            self._iteration_mode = None
            self._iteration_scale = None
        self.scaler.update(overflow)
        self._clean_in_a_row = 0 if overflow else self._clean_in_a_row + 1
        return IterationResult(
            skipped=overflow, mode=mode, loss_scale=scale, grad_norm=grad_norm,
            overflow_stages=overflow_stages,
            rolled_back_stages=rolled_back if overflow else (),
            clipped=not overflow and clip < 1.0,
        )

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> AsyncStageOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- steps of finish_iteration ------------------------------------------------------

    def _wait_all_or_undo(self) -> dict[int, tuple[bool, float]]:
        """On a failed task, the stages that did update roll back before the error
        propagates, so that a failed iteration changes nothing."""
        try:
            return self.runner.wait_all()
        except StageTaskError as error:
            for stage in error.results:
                if self.optimizer.has_update(stage):
                    self.optimizer.rollback_stage(stage)
            raise

    def _all_reduce(self, local_overflow: bool, local_sq: float) -> tuple[bool, float]:
        flags = torch.tensor([1.0 if local_overflow else 0.0, local_sq], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.process_group)
        return bool(flags[0].item() > 0), float(flags[1].item())

    def _clip_factor(self, grad_norm: float) -> float:
        if self.clip_grad <= 0.0 or not math.isfinite(grad_norm) or grad_norm <= self.clip_grad:
            return 1.0
        return self.clip_grad / (grad_norm + 1e-6)  # Megatron's clip coefficient

    def _roll_back_updated(self, checks: dict[int, tuple[bool, float]]) -> tuple[int, ...]:
        updated = tuple(s for s in sorted(checks) if self.optimizer.has_update(s))
        for stage in updated:
            self.runner.submit(stage, lambda s=stage: self.optimizer.rollback_stage(s))
        self.runner.wait_all()
        return updated

    def _update_all(self, submitted: dict[int, _Submission], inv_scale: float) -> None:
        for stage, sub in submitted.items():
            def task(stage: int = stage, sub: _Submission = sub) -> None:
                result = self.optimizer.step_stage(stage, sub.grad, inv_scale=inv_scale, out=sub.out)
                if not result.updated:  # the check passed: only a changed buffer gets here
                    raise RuntimeError(f"stage {stage}: gradient became non-finite after its check")
            self.runner.submit(stage, task)
        self.runner.wait_all()
