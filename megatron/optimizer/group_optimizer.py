"""One optimizer step per iteration over all optimizer groups (the pipeline gives each
backward stage two), in phases a program calls one by one: check / submit as gradients
land, wait_all, synchronize (the overflow and norm all-reduce: the verdict), correct
(rollback or clipped redo of speculative steps), end_iteration. finish_iteration() runs
them all, in one of two schedules:

- "async" (SysX, S 3.2 and Fig. 7b): each group's step starts as soon as its gradient
  has landed, validates that group's gradient locally and updates if it is finite; after
  all groups, one all-reduce of the overflow flags; if any group on any rank overflowed,
  every group that updated rolls back and the iteration counts as skipped.
- "sync" (Mobius, Megatron; Fig. 7a): every group's gradient is checked as it lands;
  after all groups, one all-reduce decides; then all groups update (or none).

`post_validation_after=N` runs "sync" until N clean iterations in a row, then "async"
(the SysX paper saw all its rollbacks in the first iterations, with a high initial scale).

Gradient clipping by the global norm (`clip_grad > 0`): the norm comes from the sum of
squares computed in the same pass as the check. In "sync" the clip factor is applied in
the update. In "async" the groups have already updated when the norm is known, so the
speculative step uses the clip factor predicted from the previous iteration's norm; when
the true factor differs, one fused pass per group (`CPUAdamW.correct_group`) replaces the
speculative step by the clipped one. Speculating with a factor close to the true one keeps
that correction small, hence well-conditioned (docs/cpu_optimizer.md, "Clipping"). The
corrected bits depend on the factor speculated, so the prediction is checkpointed state
(state_dict()), like the moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.optimizer.cpu_adam import CPUAdamW, check_gradient
from megatron.optimizer.group_tasks import (
    GroupTaskError,
    GroupTaskRunner,
    ReadySignal,
    wait_ready,
)
from megatron.optimizer.loss_scaler import LossScaler

MODES = ("async", "sync")


@dataclass(frozen=True)
class IterationResult:
    skipped: bool  # an overflow somewhere: no group changed this iteration
    mode: str  # the schedule this iteration ran with
    loss_scale: float  # the scale the gradients were computed with
    grad_norm: float  # global norm of the unscaled gradient (inf on overflow)
    overflow_groups: tuple[int, ...]  # local groups whose gradient was not finite
    rolled_back_groups: tuple[int, ...]  # local groups that updated, then rolled back
    clipped: bool  # the update used a clip factor < 1
    corrected_groups: tuple[int, ...] = ()  # local groups whose speculative step was re-clipped


@dataclass(frozen=True)
class _Verdict:
    """What the overflow all-reduce decided for the whole iteration."""

    overflow: bool
    grad_norm: float
    clip: float  # the clip factor (1.0: no clipping)
    overflow_groups: tuple[int, ...]  # local groups whose gradient was not finite


@dataclass
class _Submission:
    grad: torch.Tensor
    out: torch.Tensor | None


class AsyncGroupOptimizer:
    """Drives CPUAdamW once per iteration: submit() (or check()) each group as its
    gradient lands, then either the phases one by one (wait_all, synchronize, correct,
    end_iteration: what the pipeline's program does) or finish_iteration()."""

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
        thread_setup: Callable[[], None] | None = None,
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
        self.runner = GroupTaskRunner(max_workers=max_workers, thread_setup=thread_setup)
        self._clean_in_a_row = 0
        self._submitted: dict[int, _Submission] = {}
        self._speculated: set[int] = set()  # groups stepped before the verdict
        self._checks: dict[int, tuple[bool, float]] = {}  # finite, sum of squares
        self._verdict: _Verdict | None = None
        self._rolled_back: tuple[int, ...] = ()
        self._iteration_mode: str | None = None
        self._scale = 1.0
        # The clip factor of the last iteration that did not overflow: what a speculative
        # step assumes, so that its correction is small (1.0 until a norm is known).
        self.predicted_clip = 1.0
        self._spec_clip = 1.0  # the factor this iteration's speculative steps use
        self._corrected: tuple[int, ...] = ()
        # Corrections still running past the end of their iteration, by group: the group's
        # next task waits for its own (see correct_deferred).
        self._trailing: dict[int, Future] = {}

    def state_dict(self) -> dict:
        """What decides how the next iteration speculates, for a checkpoint: the clip factor
        its speculative steps assume and the clean iterations in a row (post-validation).
        A resumed run without it would speculate with 1.0 and correct with the inverse,
        which is within a few ulps of the uninterrupted run's correction, not equal."""
        return {"predicted_clip": self.predicted_clip, "clean_in_a_row": self._clean_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        clip = float(state["predicted_clip"])
        if not 0.0 < clip <= 1.0:
            raise ValueError(f"predicted_clip={clip} must lie in (0, 1]")
        self.predicted_clip = clip
        self._clean_in_a_row = int(state["clean_in_a_row"])

    def has_subgroups(self, groups: Sequence[int]) -> bool:
        """Whether any of `groups` is stepped in subgroups (some on the device)."""
        return any(self.optimizer.subgroups(g) for g in groups)

    def device_tail(self) -> tuple[float, float]:
        """(when the CPU's part of the latest steps ended, when their device subgroups
        did), in time.perf_counter() seconds: between the two only the device worked."""
        return self.optimizer.device_tail()

    def current_mode(self) -> str:
        """The schedule the next (or current) iteration runs with."""
        if self._iteration_mode is not None:
            return self._iteration_mode
        if self.mode == "async" and self._clean_in_a_row < self.post_validation_after:
            return "sync"
        return self.mode

    def submit(
        self,
        group: int,
        grad: torch.Tensor,
        ready: ReadySignal = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Schedule group's step: it starts once `ready` says the gradient has landed.
        `grad` and `out` must stay untouched until end_iteration() returns.

        Before the overflow verdict (synchronize()) this is a speculative step that checks
        its own gradient ("async"), or only the check when the optimizer runs "sync" through
        finish_iteration(); after the verdict it is the deferred update, skipped on overflow
        and scaled by the clip factor."""
        if group in self._submitted:
            raise ValueError(f"group {group} was already submitted in this iteration")
        self.optimizer.check_inputs(group, grad, out)  # fail here, not in a task
        self._begin()
        ready = self._after_trailing(group, ready)
        self._submitted[group] = _Submission(grad, out)
        if self._verdict is not None:
            if not self._verdict.overflow:
                self._update(group, self._submitted[group], self._verdict.clip, ready)
            else:
                self.optimizer.skip(group)
        elif self._iteration_mode == "async":
            self._speculated.add(group)
            self.runner.submit(group, self._speculative_task(group, grad, out), ready)
        else:
            self.runner.submit(group, self._check_task(grad), ready)

    def check(self, group: int, grad: torch.Tensor, ready: ReadySignal = None) -> None:
        """Start the overflow check and sum of squares of a gradient that is not stepped
        before the verdict (the synchronous schedules' check as gradients land)."""
        self.optimizer.check_inputs(group, grad)
        self._begin()
        self.runner.submit(group, self._check_task(grad), self._after_trailing(group, ready))

    def wait_all(self) -> None:
        """Wait for every started task; a failed task undoes the updates of this round."""
        for group, (ok, sq) in self._wait_all_or_undo().items():
            if ok is not None:  # a check or a speculative step: its verdict counts
                self._checks[group] = (ok, sq)

    def synchronize(self) -> float:
        """One all-reduce of the overflow flags and squared norms over the process group:
        the verdict every later submit() and correct() follows. Returns the global norm."""
        self._begin()
        overflow_groups = tuple(s for s, (finite, _) in sorted(self._checks.items()) if not finite)
        local_sq = sum(sq for finite, sq in self._checks.values() if finite)
        overflow, global_sq = self._all_reduce(len(overflow_groups) > 0, local_sq)
        grad_norm = math.inf if overflow else math.sqrt(global_sq)
        self._verdict = _Verdict(overflow, grad_norm, self._clip_factor(grad_norm),
                                 overflow_groups)
        return grad_norm

    def correct(self, order: Sequence[int] | None = None) -> None:
        """After the verdict: undo every speculative update when it says overflow, and
        re-clip them in one fused pass each when the true clip factor differs from the
        predicted one; returns when all are done. `order`: the groups in the order they are
        needed next; the others follow in group order."""
        needed = self._needing_correction()
        first = [s for s in (order or ()) if s in needed]
        for group in dict.fromkeys(first + needed):
            self.runner.submit(group, lambda s=group, v=self._verdict: self._correct_group(s, v))
        self.runner.wait_all()

    def correct_deferred(
        self, batches: Sequence[tuple[Sequence[int], Callable[[], None]]],
    ) -> list[Future | None]:
        """correct() without waiting: one task per batch of groups, in the order given (the
        next iteration's forward order), that corrects those of its groups that need it,
        commits them, then calls the batch's `then` (e.g. publish the stage's parameters).
        A batch with nothing to correct gets None: its caller runs `then` itself. The
        next submit() or check() of a group waits for its correction; drain() waits for
        all (before anything reads the state)."""
        needed = set(self._needing_correction())
        futures: list[Future | None] = []
        for groups, then in batches:
            mine = tuple(g for g in groups if g in needed)
            if not mine:
                futures.append(None)
                continue

            def task(mine: tuple[int, ...] = mine, then: Callable[[], None] = then,
                     verdict: _Verdict = self._verdict) -> None:
                try:
                    for group in mine:
                        self._correct_group(group, verdict)
                        self.optimizer.commit_group(group)
                finally:
                    for group in mine:
                        self.optimizer.release(group)
                then()
            for group in mine:  # states on disk: the next read of the group waits for it
                self.optimizer.reserve(group)
            future = self.runner.submit_detached(task)
            for group in mine:
                self._trailing[group] = future
            futures.append(future)
        return futures

    def drain(self) -> None:
        """Wait for every deferred correction; raises GroupTaskError for a failed one."""
        trailing, self._trailing = self._trailing, {}
        for group, future in sorted(trailing.items()):
            try:
                future.result()
            except BaseException as error:
                raise GroupTaskError(group, error, {}) from error

    def _needing_correction(self) -> list[int]:
        """The speculative updates the verdict changes (recorded for the result)."""
        verdict = self._verdict
        if verdict is None:
            raise RuntimeError("correct() before synchronize()")
        if not verdict.overflow and verdict.clip == self._spec_clip:
            return []
        updated = tuple(s for s in sorted(self._speculated) if self.optimizer.has_update(s))
        if verdict.overflow:
            self._rolled_back = updated
        else:
            self._corrected = updated
        return list(updated)

    def _correct_group(self, group: int, verdict: _Verdict) -> None:
        if verdict.overflow:
            self.optimizer.rollback_group(group)
        else:
            self.optimizer.correct_group(group, verdict.clip)

    def _after_trailing(self, group: int, ready: ReadySignal) -> ReadySignal:
        """`ready`, preceded by the group's deferred correction if one is running."""
        future = self._trailing.pop(group, None)
        if future is None:
            return ready

        def wait() -> None:
            future.result()
            wait_ready(ready)
        return wait

    def end_iteration(self) -> IterationResult:
        """Commit this iteration's updates, adjust the loss scale, report."""
        verdict = self._verdict
        if verdict is None:
            raise RuntimeError("end_iteration() before synchronize()")
        if self.runner.pending_groups:
            raise RuntimeError(f"optimizer tasks of groups {self.runner.pending_groups} "
                               "were never waited for")
        mode = "async" if self._speculated else "sync"
        result = IterationResult(
            skipped=verdict.overflow, mode=mode, loss_scale=self._scale,
            grad_norm=verdict.grad_norm, overflow_groups=verdict.overflow_groups,
            rolled_back_groups=self._rolled_back if verdict.overflow else (),
            clipped=not verdict.overflow and verdict.clip < 1.0,
            corrected_groups=self._corrected,
        )
        if not verdict.overflow:
            self.predicted_clip = verdict.clip
        for group in self._submitted:
            if group not in self._trailing:  # a deferred correction commits its own
                self.optimizer.commit_group(group)
        self._reset()
        self.scaler.update(verdict.overflow)
        self._clean_in_a_row = 0 if verdict.overflow else self._clean_in_a_row + 1
        return result

    def finish_iteration(self) -> IterationResult:
        """Waits for every group, synchronizes the flags across ranks, rolls back or
        updates, and adjusts the loss scale (the whole optimizer phase in one call)."""
        try:
            self.wait_all()
            self.synchronize()
            if self._speculated:
                self.correct()
            elif not self._verdict.overflow:
                for group, sub in self._submitted.items():
                    self._update(group, sub, self._verdict.clip)
                self.runner.wait_all()
        except BaseException:
            self._reset()
            raise
        return self.end_iteration()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.runner.close()

    def __enter__(self) -> AsyncGroupOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the pieces of an iteration ----------------------------------------------------

    def _begin(self) -> None:
        if self._iteration_mode is None:
            self._iteration_mode = self.current_mode()
            self._scale = self.scaler.scale
            self._spec_clip = self.predicted_clip if self.clip_grad > 0.0 else 1.0

    def _reset(self) -> None:
        self._submitted = {}
        self._speculated = set()
        self._checks = {}
        self._verdict = None
        self._rolled_back = ()
        self._corrected = ()
        self._iteration_mode = None
        self._scale = 1.0

    def _speculative_task(self, group: int, grad: torch.Tensor, out: torch.Tensor | None):
        inv_scale, clip = 1.0 / self._scale, self._spec_clip

        def task() -> tuple[bool, float]:
            result = self.optimizer.step_group(group, grad, inv_scale=inv_scale, out=out,
                                               clip=clip)
            return result.updated, result.grad_sq_sum
        return task

    def _check_task(self, grad: torch.Tensor):
        adam, inv_scale = self.optimizer, 1.0 / self._scale

        def task() -> tuple[bool, float]:
            return check_gradient(grad, inv_scale, adam.threads, adam.isa, adam.cores)
        return task

    def _update(self, group: int, sub: _Submission, clip: float,
                ready: ReadySignal = None) -> None:
        inv_scale = 1.0 / self._scale

        def task() -> tuple[None, float]:
            result = self.optimizer.step_group(group, sub.grad, inv_scale=inv_scale,
                                               out=sub.out, clip=clip)
            if not result.updated:  # the check passed: only a changed buffer gets here
                raise RuntimeError(f"group {group}: gradient became non-finite after its check")
            return None, 0.0
        self.runner.submit(group, task, ready)

    def _wait_all_or_undo(self) -> dict[int, tuple[bool | None, float]]:
        """On a failed task, the groups that did update roll back before the error
        propagates, so that a failed iteration changes nothing."""
        try:
            return self.runner.wait_all()
        except GroupTaskError as error:
            for group in error.results:
                if self.optimizer.has_update(group):
                    self.optimizer.rollback_group(group)
            self._reset()
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
