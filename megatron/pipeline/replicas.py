"""Parameters of stages whose owner is on another node.

A backward stage's segment lives on its owner's node. A node where another rank runs that
stage's forward (or, in general, reads the segment) holds a replica: its lowest such rank
creates a segment of the same key in its node's store and receives every published
version from the owner (SysX fetches over RDMA; we push over torch.distributed).

The pushes are asynchronous and per stage (`ParameterDistributor`): a thread of their own,
on a gloo group of their own, sends each stage as soon as its owner publishes the new
version (at the end of the iteration, or when its deferred correction is done) and the
holder publishes it in its replica, while the next iteration already runs; a forward on the
holder's node waits for its own stage's version only. Every rank walks the replicas in one
order, the forward order of the stages (the order the next iteration needs them and the
order corrections publish them), so between any two ranks the sends and the receives are
posted in the same order, as NCCL requires, and the blocking transfers cannot deadlock.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron.offload.multinode import push_parameters, receive_parameters
from megatron.offload.param_store import ParameterStore
from megatron.schedules.instructions import BackwardStage
from megatron.schedules.replica_plan import Replica
from megatron.schedules.timeline import TimedEvent


def global_replicas(plan: list[Replica], global_rank: Callable[[int, int], int]
                    ) -> list[Replica]:
    """A plan made over pipeline ranks, with the first data-parallel replica of each
    owner and holder doing the transfers (`global_rank(pipeline_rank, dp_rank)`)."""
    return [Replica(r.backward_stage, global_rank(r.owner, 0),
                    tuple(global_rank(h, 0) for h in r.holders)) for r in plan]


def holds_segment(plan: list[Replica], rank: int) -> set[BackwardStage]:
    """The replica segments this rank creates (beside the segments of what it owns)."""
    return {r.backward_stage for r in plan if rank in r.holders}


# Testing aid: seconds each cross-node push waits before sending, a slow inter-node link
# (the tests use it to see the transfers overlap the next iteration's compute).
LINK_DELAY_ENV = "MEGATRON_SYSX_TEST_LINK_DELAY_S"
_VERSION_POLL_S = 1.0  # how often a sender waiting for a version checks for close()


@dataclass(frozen=True)
class Transfer:
    """One replica moved: the owner's send or the holder's receive, host seconds."""

    backward_stage: BackwardStage
    version: int
    sent: bool
    start_s: float
    end_s: float


class ParameterDistributor:
    """Pushes every published version of the stages in `plan` from owner to holders on one
    background thread, per stage, in plan order (see the module docstring).

    `distribute(version)` returns at once; `drain()` waits for every push queued so far and
    raises the first failure. `group` must move host tensors (gloo) and be used by nothing
    else, so its transfers never interleave with the main thread's collectives."""

    def __init__(self, plan: list[Replica], store: ParameterStore, rank: int,
                 group: dist.ProcessGroup | None,
                 thread_setup: Callable[[], None] | None = None) -> None:
        self.mine = [r for r in plan if rank == r.owner or rank in r.holders]
        self.store, self.rank, self.group = store, rank, group
        self.link_delay_s = float(os.environ.get(LINK_DELAY_ENV, "0") or 0)
        self.transfers: list[Transfer] = []  # since the last take_transfers()
        self._lock = threading.Lock()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        if self.mine:
            # A daemon: if a peer died mid-transfer, the process can still exit.
            self._thread = threading.Thread(target=self._run, args=(thread_setup,),
                                            name="param-distribution", daemon=True)
            self._thread.start()

    def distribute(self, version: int, republish: bool = False) -> None:
        """Queue the pushes of `version` of every stage (each once its owner publishes it;
        `republish`: the version the replicas hold, rewritten by a checkpoint load)."""
        self._raise_failure()
        if self._thread is None:
            return
        with self._done:
            self._pending += 1
        self._queue.put((version, republish))

    def drain(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self._pending == 0 or self._error is not None)
        self._raise_failure()

    def take_transfers(self) -> list[Transfer]:
        with self._lock:
            taken, self.transfers = self.transfers, []
        return taken

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop after the pushes queued so far: every rank queued the same versions, so
        they complete unless a peer died (then give up after `timeout_s`; the thread is a
        daemon and goes with the process)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout=0.0 if self._error is not None else timeout_s)
        self._closing = True  # a sender still waiting for a version gives up
        self._thread = None

    # --- the thread ----------------------------------------------------------------------

    def _run(self, thread_setup: Callable[[], None] | None) -> None:
        if thread_setup is not None:
            thread_setup()
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    for replica in self.mine:
                        self._move(replica, *item)
            except BaseException as exc:  # reported to the main thread by drain/distribute
                self._error = exc
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _move(self, replica: Replica, version: int, republish: bool = False) -> None:
        segment = self.store.get(replica.backward_stage)
        sent = self.rank == replica.owner
        if sent:
            self._wait_published(segment, version)
            start = time.perf_counter()
            if self.link_delay_s:
                time.sleep(self.link_delay_s)
            push_parameters(segment, list(replica.holders), group=self.group, version=version)
            end = time.perf_counter()
        else:
            start = time.perf_counter()
            # the receipt ends when the bytes are in, before the version is published: a
            # forward waiting for it may run before this thread is scheduled again
            arrived: list[float] = []
            receive_parameters(segment, replica.owner, group=self.group, republish=republish,
                               on_arrival=lambda: arrived.append(time.perf_counter()))
            end = arrived[0]
        with self._lock:
            self.transfers.append(Transfer(replica.backward_stage, version, sent, start, end))

    def _wait_published(self, segment, version: int) -> None:
        while True:
            try:
                segment.wait_version(version, timeout_s=_VERSION_POLL_S)
                return
            except TimeoutError:
                if self._closing:
                    raise

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"parameter distribution to other nodes failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error


def transfer_events(transfers: list[Transfer], rank: int, origin_s: float) -> list[TimedEvent]:
    """Transfers as timeline events (seconds from `origin_s`, the iteration's start), on the
    network lane: "d3,1" a push of stage (3, 1), "r3,1" its receipt in the replica."""
    return [TimedEvent(rank, "network", t.start_s - origin_s, t.end_s - origin_s,
                       f"{'d' if t.sent else 'r'}{t.backward_stage[0]},{t.backward_stage[1]}",
                       "distribution", t.backward_stage[0], t.backward_stage[1])
            for t in transfers]
