"""Per-group asynchronous tasks: each waits for its group's "gradient landed" signal,
then runs on a worker thread while the caller goes on (S 3.2, Fig. 7b)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

# A signal that the group's gradient is in host memory: None (already there), an object
# with wait() (threading.Event, the offload device layer's events), a Future, a
# torch.cuda.Event, or a callable that blocks until then.
ReadySignal = Any


class GroupTaskError(RuntimeError):
    """A group's task failed; the original exception is the __cause__. `results` holds
    what the other groups' tasks returned (so that a caller can undo their work)."""

    def __init__(self, group: int, error: BaseException, results: dict[int, Any]) -> None:
        super().__init__(f"optimizer task of group {group} failed: {type(error).__name__}: {error}")
        self.group = group
        self.results = results


def wait_ready(ready: ReadySignal) -> None:
    if ready is None:
        return
    if isinstance(ready, torch.cuda.Event):  # its wait() only orders a stream
        ready.synchronize()
    elif isinstance(ready, Future):
        ready.result()
    elif isinstance(ready, threading.Event):
        ready.wait()
    elif hasattr(ready, "wait"):
        ready.wait()
    elif callable(ready):
        ready()
    else:
        raise TypeError(f"ready={ready!r}: expected None, an event with wait(), a Future or a callable")


class GroupTaskRunner:
    """Runs group tasks on `max_workers` threads (each task's kernel runs on the
    process's kernel pool). submit() returns at once; wait_all() returns when every
    submitted task has finished and raises GroupTaskError for the lowest failed group.

    thread_setup runs once in each worker thread before its first task: on CUDA it sets the
    thread's device, since a worker waits on CUDA events and a thread left on device 0 would
    open a context there on every rank of the node."""

    def __init__(self, max_workers: int = 2, name: str = "cpu-optimizer",
                 thread_setup: Callable[[], None] | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                        initializer=thread_setup)
        self._pending: dict[int, Future] = {}
        self._closed = False

    def submit(self, group: int, task: Callable[[], Any], ready: ReadySignal = None) -> Future:
        if self._closed:
            raise RuntimeError("GroupTaskRunner is closed")
        if group in self._pending:
            raise ValueError(f"group {group} already has a task in this round; call wait_all() first")

        def run() -> Any:
            wait_ready(ready)
            return task()

        future = self._pool.submit(run)
        self._pending[group] = future
        return future

    def submit_detached(self, task: Callable[[], Any]) -> Future:
        """Run `task` on the same threads, outside the rounds that wait_all() closes: work
        that may go on past the end of the iteration (the caller keeps the Future). The
        threads take tasks in submission order, so a later task may wait for this one."""
        if self._closed:
            raise RuntimeError("GroupTaskRunner is closed")
        return self._pool.submit(task)

    def wait_all(self) -> dict[int, Any]:
        """Results by group, once all tasks of the round are done; starts a new round."""
        pending, self._pending = self._pending, {}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for group, future in pending.items():
            try:
                results[group] = future.result()
            except BaseException as error:  # noqa: BLE001 - reported below, naming the group
                errors[group] = error
        if errors:
            group = min(errors)
            raise GroupTaskError(group, errors[group], results) from errors[group]
        return results

    @property
    def pending_groups(self) -> list[int]:
        return sorted(self._pending)

    def close(self) -> None:
        """Waits for running tasks and joins every worker thread."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)

    def __enter__(self) -> GroupTaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
