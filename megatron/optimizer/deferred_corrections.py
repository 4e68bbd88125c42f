"""Corrections that run past the end of their iteration (correct_deferred): one task per
batch of groups, in the order the next iteration needs them, each correcting, committing
and then publishing its groups; the next task of a corrected group waits for its
correction first, and drain() waits for all of them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future

from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.group_tasks import GroupTaskError, GroupTaskRunner, ReadySignal, wait_ready

Batch = tuple[Sequence[int], Callable[[], None]]


class DeferredCorrections:
    def __init__(self, optimizer: CPUAdamW, runner: GroupTaskRunner) -> None:
        self.optimizer, self.runner = optimizer, runner
        # Corrections still running, by group: the group's next task waits for its own.
        self._trailing: dict[int, Future] = {}

    def start(self, batches: Sequence[Batch], needed: Collection[int],
              correct: Callable[[int], None]) -> list[Future | None]:
        """One task per batch with groups in `needed`: `correct` each, commit it, then the
        batch's `then`. A batch with nothing to correct gets None (its caller runs `then`)."""
        futures: list[Future | None] = []
        for groups, then in batches:
            mine = tuple(g for g in groups if g in needed)
            if not mine:
                futures.append(None)
                continue

            def task(mine: tuple[int, ...] = mine, then: Callable[[], None] = then) -> None:
                try:
                    for group in mine:
                        correct(group)
                        self.optimizer.commit_group(group)
                finally:
                    for group in mine:
                        self.optimizer.storage.release(group)
                then()
            for group in mine:  # states on disk: the next read of the group waits for it
                self.optimizer.storage.reserve(group)
            future = self.runner.submit_detached(task)
            for group in mine:
                self._trailing[group] = future
            futures.append(future)
        return futures

    def running(self, group: int) -> bool:
        """Whether the group's correction commits it (not the end of the iteration)."""
        return group in self._trailing

    def after(self, group: int, ready: ReadySignal) -> ReadySignal:
        """`ready`, preceded by the group's deferred correction if one is running."""
        future = self._trailing.pop(group, None)
        if future is None:
            return ready

        def wait() -> None:
            future.result()
            wait_ready(ready)
        return wait

    def drain(self) -> None:
        """Wait for every deferred correction; raises GroupTaskError for a failed one."""
        trailing, self._trailing = self._trailing, {}
        for group, future in sorted(trailing.items()):
            try:
                future.result()
            except BaseException as error:
                raise GroupTaskError(group, error, {}) from error
