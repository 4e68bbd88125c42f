"""Rollback and speculation bookkeeping of CPUAdamW: per group, its step count, the record
of its last update while that update may still be rolled back or corrected (a
speculative step awaiting the iteration's verdict), and, for bit-exact rollbacks of
states in host memory, the snapshot the kernel takes of the state a step changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.optimizer.adam_kernel import StepRecord


class StepLedger:
    """`snapshot_bytes_per_param` > 0: keep a snapshot of p, m, v per group ([p | m | v]
    per element range, each in its own dtype), which the kernel fills at each step."""

    def __init__(self, numels: Sequence[int], snapshot_bytes_per_param: int = 0) -> None:
        self._steps = [0] * len(numels)
        self._last: list[StepRecord | None] = [None] * len(numels)
        self._bytes_per_param = snapshot_bytes_per_param
        self._snapshots = [torch.empty(n * snapshot_bytes_per_param, dtype=torch.uint8)
                           if snapshot_bytes_per_param else None for n in numels]

    def step_count(self, group: int) -> int:
        return self._steps[group]

    def next_step(self, group: int) -> int:
        """The step number the group's next update takes (Adam's bias correction)."""
        return self._steps[group] + 1

    def has_update(self, group: int) -> bool:
        return self._last[group] is not None

    def pending(self, group: int, what: str) -> StepRecord:
        """The group's update that may still be undone; `what` names the caller's purpose
        in the error when there is none (e.g. "roll back")."""
        record = self._last[group]
        if record is None:
            raise RuntimeError(f"group {group} has no update to {what}")
        return record

    def stepped(self, group: int, record: StepRecord, updated: bool) -> None:
        """A step ran: it counts, and stays undoable, only when it updated the group."""
        if updated:
            self._steps[group] = record.step
            self._last[group] = record
        else:
            self._last[group] = None

    def rolled_back(self, group: int, record: StepRecord) -> None:
        self._steps[group] = record.step - 1
        self._last[group] = None

    def corrected(self, group: int, record: StepRecord) -> None:
        """The group's update is now `record` (the same step with another clip factor)."""
        self._last[group] = record

    def commit(self, group: int) -> None:
        """The update is final: its gradient may be reused from now on."""
        self._last[group] = None

    def load(self, group: int, step: int) -> None:
        """A checkpoint's state was loaded: its step count, nothing to undo."""
        self._steps[group] = step
        self._last[group] = None

    # --- the snapshot (bit-exact rollbacks in host memory) --------------------------------

    def snapshot(self, group: int, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
        """The bytes of the group's snapshot that hold elements [lo, hi) (hi None: the
        whole group), or None when no snapshots are kept."""
        snap = self._snapshots[group]
        if snap is None or hi is None:
            return snap
        return snap[lo * self._bytes_per_param:hi * self._bytes_per_param]

    def snapshot_parts(self, group: int, lo: int, hi: int,
                       dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        """p, m, v of the snapshot block of elements [lo, hi), as views of `dtypes`."""
        block, width, parts, at = self.snapshot(group, lo, hi), hi - lo, [], 0
        for dtype in dtypes:
            size = width * dtype.itemsize
            parts.append(block[at:at + size].view(dtype))
            at += size
        return parts

    def snapshot_nbytes(self) -> int:
        return sum(s.nbytes for s in self._snapshots if s is not None)
