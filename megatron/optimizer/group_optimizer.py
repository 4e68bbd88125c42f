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

Parts: the verdict (iteration_verdict.py), what the next iteration speculates with
(speculation.py), the corrections that run past their iteration (deferred_corrections.py);
AsyncGroupOptimizer holds the iteration in progress and runs its phases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.optimizer.cpu_adam import CPUAdamW, check_gradient
from megatron.optimizer.deferred_corrections import Batch, DeferredCorrections
from megatron.optimizer.group_tasks import GroupTaskError, GroupTaskRunner, ReadySignal
from megatron.optimizer.iteration_verdict import Verdict, reach_verdict
from megatron.optimizer.loss_scaler import LossScaler
from megatron.optimizer.speculation import Speculation


@dataclass(frozen=True)
class IterationResult:
    skipped: bool  # an overflow somewhere: no group changed this iteration
    mode: str  # the schedule this iteration ran with
    loss_scale: float  # the scale after this iteration's update (Megatron's logged one)
    grad_norm: float  # global norm of the unscaled gradient (inf on overflow)
    overflow_groups: tuple[int, ...]  # local groups whose gradient was not finite
    rolled_back_groups: tuple[int, ...]  # local groups that updated, then rolled back
    clipped: bool  # the update used a clip factor < 1
    corrected_groups: tuple[int, ...] = ()  # local groups whose speculative step was re-clipped


@dataclass
class _Submission:
    grad: torch.Tensor
    out: torch.Tensor | None


@dataclass
class _Round:
    """The iteration in progress, from its first submit() or check() to end_iteration()."""

    mode: str  # the schedule it runs with
    scale: float  # the loss scale its gradients were computed with
    spec_clip: float  # the clip factor its speculative steps use
    submitted: dict[int, _Submission] = field(default_factory=dict)
    speculated: set[int] = field(default_factory=set)  # groups stepped before the verdict
    checks: dict[int, tuple[bool, float]] = field(default_factory=dict)  # finite, sum of sq.
    verdict: Verdict | None = None
    rolled_back: tuple[int, ...] = ()
    corrected: tuple[int, ...] = ()

    def needing_correction(self, optimizer: CPUAdamW) -> list[int]:
        """The speculative updates the verdict changes (recorded for the result)."""
        verdict = self.verdict
        if verdict is None:
            raise RuntimeError("correct() before synchronize()")
        if not verdict.overflow and verdict.clip == self.spec_clip:
            return []
        updated = tuple(s for s in sorted(self.speculated) if optimizer.has_update(s))
        if verdict.overflow:
            self.rolled_back = updated
        else:
            self.corrected = updated
        return list(updated)


def _correct_group(optimizer: CPUAdamW, group: int, verdict: Verdict) -> None:
    if verdict.overflow:
        optimizer.rollback_group(group)
    else:
        optimizer.correct_group(group, verdict.clip)


def _speculative_task(optimizer: CPUAdamW, group: int, grad: torch.Tensor,
                      out: torch.Tensor | None, inv_scale: float,
                      clip: float) -> Callable[[], tuple[bool, float]]:
    def task() -> tuple[bool, float]:
        result = optimizer.step_group(group, grad, inv_scale=inv_scale, out=out, clip=clip)
        return result.updated, result.grad_sq_sum
    return task


def _check_task(optimizer: CPUAdamW, grad: torch.Tensor,
                inv_scale: float) -> Callable[[], tuple[bool, float]]:
    def task() -> tuple[bool, float]:
        return check_gradient(grad, inv_scale, optimizer.threads, optimizer.isa, optimizer.cores)
    return task


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
        self.speculation = Speculation(mode, post_validation_after, clip_grad)
        self.optimizer = optimizer
        self.scaler = scaler
        self.process_group = process_group
        self.runner = GroupTaskRunner(max_workers=max_workers, thread_setup=thread_setup)
        self.deferred = DeferredCorrections(optimizer, self.runner)
        self._round: _Round | None = None

    def state_dict(self) -> dict:
        """What decides how the next iteration speculates, for a checkpoint: the clip factor
        its speculative steps assume and the clean iterations in a row (post-validation).
        A resumed run without it would speculate with 1.0 and correct with the inverse,
        which is within a few ulps of the uninterrupted run's correction, not equal."""
        return self.speculation.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.speculation.load_state_dict(state)

    def has_subgroups(self, groups: Sequence[int]) -> bool:
        """Whether any of `groups` is stepped in subgroups (some on the device)."""
        return any(self.optimizer.subgroups(g) for g in groups)

    def device_tail(self) -> tuple[float, float]:
        """(when the CPU's part of the latest steps ended, when their device subgroups
        did), in time.perf_counter() seconds: between the two only the device worked."""
        return self.optimizer.device_tail()

    def current_mode(self) -> str:
        """The schedule the next (or current) iteration runs with."""
        return self._round.mode if self._round is not None else self.speculation.next_mode()

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
        if self._round is not None and group in self._round.submitted:
            raise ValueError(f"group {group} was already submitted in this iteration")
        self.optimizer.check_inputs(group, grad, out)  # fail here, not in a task
        r = self._begin()
        ready = self.deferred.after(group, ready)
        r.submitted[group] = _Submission(grad, out)
        if r.verdict is not None:
            if not r.verdict.overflow:
                self._update(group, r.submitted[group], r.verdict.clip, ready)
            else:
                self.optimizer.storage.skip(group)
        elif r.mode == "async":
            r.speculated.add(group)
            self.runner.submit(group, _speculative_task(
                self.optimizer, group, grad, out, 1.0 / r.scale, r.spec_clip), ready)
        else:
            self.runner.submit(group, _check_task(self.optimizer, grad, 1.0 / r.scale), ready)

    def check(self, group: int, grad: torch.Tensor, ready: ReadySignal = None) -> None:
        """Start the overflow check and sum of squares of a gradient that is not stepped
        before the verdict (the synchronous schedules' check as gradients land)."""
        self.optimizer.check_inputs(group, grad)
        r = self._begin()
        self.runner.submit(group, _check_task(self.optimizer, grad, 1.0 / r.scale),
                           self.deferred.after(group, ready))

    def wait_all(self) -> None:
        """Wait for every started task; a failed task undoes the updates of this round."""
        for group, (ok, sq) in self._wait_all_or_undo().items():
            if ok is not None:  # a check or a speculative step: its verdict counts
                self._round.checks[group] = (ok, sq)

    def synchronize(self) -> float:
        """One all-reduce of the overflow flags and squared norms over the process group:
        the verdict every later submit() and correct() follows. Returns the global norm."""
        r = self._begin()
        r.verdict = reach_verdict(r.checks, self.speculation.clip_grad, self.process_group)
        return r.verdict.grad_norm

    def correct(self, order: Sequence[int] | None = None) -> None:
        """After the verdict: undo every speculative update when it says overflow, and
        re-clip them in one fused pass each when the true clip factor differs from the
        predicted one; returns when all are done. `order`: the groups in the order they are
        needed next; the others follow in group order."""
        r = self._current("correct()")
        needed = r.needing_correction(self.optimizer)
        first = [s for s in (order or ()) if s in needed]
        for group in dict.fromkeys(first + needed):
            self.runner.submit(group, lambda s=group, v=r.verdict: _correct_group(
                self.optimizer, s, v))
        self.runner.wait_all()

    def correct_deferred(self, batches: Sequence[Batch]) -> list[Future | None]:
        """correct() without waiting: one task per batch of groups, in the order given (the
        next iteration's forward order), that corrects those of its groups that need it,
        commits them, then calls the batch's `then` (e.g. publish the stage's parameters).
        A batch with nothing to correct gets None: its caller runs `then` itself. The
        next submit() or check() of a group waits for its correction; drain() waits for
        all (before anything reads the state)."""
        r = self._current("correct()")
        needed = set(r.needing_correction(self.optimizer))
        return self.deferred.start(batches, needed, lambda group, v=r.verdict: _correct_group(
            self.optimizer, group, v))

    def drain(self) -> None:
        """Wait for every deferred correction; raises GroupTaskError for a failed one."""
        self.deferred.drain()

    def end_iteration(self) -> IterationResult:
        """Commit this iteration's updates, adjust the loss scale, report."""
        r = self._current("end_iteration()")
        verdict = r.verdict
        if verdict is None:
            raise RuntimeError("end_iteration() before synchronize()")
        if self.runner.pending_groups:
            raise RuntimeError(f"optimizer tasks of groups {self.runner.pending_groups} "
                               "were never waited for")
        self.scaler.update(verdict.overflow)
        result = IterationResult(
            skipped=verdict.overflow, mode="async" if r.speculated else "sync",
            loss_scale=self.scaler.scale, grad_norm=verdict.grad_norm,
            overflow_groups=verdict.overflow_groups,
            rolled_back_groups=r.rolled_back if verdict.overflow else (),
            clipped=not verdict.overflow and verdict.clip < 1.0,
            corrected_groups=r.corrected,
        )
        self.speculation.ended(verdict.overflow, verdict.clip)
        for group in r.submitted:
            if not self.deferred.running(group):  # a deferred correction commits its own
                self.optimizer.commit_group(group)
        self._round = None
        return result

    def finish_iteration(self) -> IterationResult:
        """Waits for every group, synchronizes the flags across ranks, rolls back or
        updates, and adjusts the loss scale (the whole optimizer phase in one call)."""
        try:
            self.wait_all()
            r = self._begin()
            self.synchronize()
            if r.speculated:
                self.correct()
            elif not r.verdict.overflow:
                for group, sub in r.submitted.items():
                    self._update(group, sub, r.verdict.clip)
                self.runner.wait_all()
        except BaseException:
            self._round = None
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

    def _begin(self) -> _Round:
        """The iteration in progress, started now if none is."""
        if self._round is None:
            self._round = _Round(self.speculation.next_mode(), self.scaler.scale,
                                 self.speculation.speculative_clip())
        return self._round

    def _current(self, what: str) -> _Round:
        if self._round is None:
            raise RuntimeError(f"{what} before synchronize()")
        return self._round

    def _update(self, group: int, sub: _Submission, clip: float,
                ready: ReadySignal = None) -> None:
        inv_scale = 1.0 / self._round.scale

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
            self._round = None
            raise
