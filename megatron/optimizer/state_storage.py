"""Where CPUAdamW's p, m, v live, behind one interface: host memory (HostStorage) or a
state file on NVMe with a window in host memory (DiskStorage, over disk_states.py).

A tier hands a step the group's tensors, restores them for a rollback and re-runs the step
for a clipping correction in its own way; the numbers never depend on the tier. In host
memory a rollback runs the kernel's inverse (from the snapshot in exact mode). On disk,
exact mode needs no snapshot: the file keeps the committed version, which a rollback
returns to and a correction steps again from; without exact mode, both run the same
inverse as host memory on the staged state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from megatron.optimizer.adam_kernel import AdamKernel, GroupTensors, StepRecord
from megatron.optimizer.disk_states import DiskStates
from megatron.optimizer.step_ledger import StepLedger
from megatron.optimizer.subgroup_share import SubgroupShare

StepRun = Callable[[GroupTensors], tuple[bool, float]]


class StateStorage(Protocol):
    """What CPUAdamW asks of the tier that holds p, m, v."""

    def states(self, group: int) -> GroupTensors:
        """p, m, v for a reader: live buffers in host memory; on disk, views of the
        committed state in the mapped file (valid until the group's next commit)."""

    def load(self, group: int, p: torch.Tensor, m: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> None:
        """Set the group's state (m, v zero when not given)."""

    def host_bytes(self) -> int:
        """Host bytes held for p, m, v (and snapshots, or the window)."""

    def step(self, group: int, run: StepRun) -> tuple[bool, float]:
        """`run` over the group's tensors: (finite, sum of squares)."""

    def rollback(self, group: int, record: StepRecord) -> None:
        """Restore the state before the step `record` (and the working copy it wrote)."""

    def correct(self, group: int, record: StepRecord, corrected: StepRecord) -> None:
        """Replace the step `record` by `corrected` (the same step, another clip)."""

    def commit(self, group: int) -> None:
        """The group's update is final."""

    # The program's traffic of states on disk (no-ops in host memory):
    def request_read(self, group: int) -> None:
        """READ_OPTIMIZER_STATES of the group (returns at once)."""

    def request_write(self, group: int) -> None:
        """WRITE_OPTIMIZER_STATES: the group's step result goes to the file (at once)."""

    def skip(self, group: int) -> None:
        """The group is not stepped this iteration (an overflow verdict came first)."""

    def reserve(self, group: int) -> None:
        """A rollback or correction of the group will run: its next read waits for it."""

    def release(self, group: int) -> None:
        """That rollback or correction is done."""


class HostStorage:
    """p, m, v of every group in host memory; the device's share (a resident updater)
    may hold the current values of some ranges, written back before a host reader."""

    def __init__(self, params: Sequence[torch.Tensor], kernel: AdamKernel,
                 share: SubgroupShare, ledger: StepLedger, adopt: bool = False) -> None:
        """`adopt`: a param already contiguous in the master dtype is the master (no copy)."""
        self._kernel, self._share, self._ledger = kernel, share, ledger
        self._tensors = [(p.detach().to(kernel.master_dtype, copy=not adopt).contiguous(),
                          torch.zeros(p.numel(), dtype=kernel.state_dtype),
                          torch.zeros(p.numel(), dtype=kernel.state_dtype)) for p in params]

    def states(self, group: int) -> GroupTensors:
        tensors = self._tensors[group]
        self._share.to_host(group, tensors)
        return tensors

    def load(self, group: int, p: torch.Tensor, m: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> None:
        tensors = self._tensors[group]
        for dst, src in zip(tensors, (p, m, v)):
            dst.copy_(src) if src is not None else dst.zero_()
        self._share.changed(group, tensors)

    def host_bytes(self) -> int:
        return sum(t.nbytes for tensors in self._tensors for t in tensors) \
            + self._ledger.snapshot_nbytes()

    def step(self, group: int, run: StepRun) -> tuple[bool, float]:
        return run(self._tensors[group])

    def rollback(self, group: int, record: StepRecord) -> None:
        self._redo(group, record, lambda call: self._kernel.undo(call))

    def correct(self, group: int, record: StepRecord, corrected: StepRecord) -> None:
        self._redo(group, corrected, lambda call: self._kernel.correct(call, record.clip))

    def _redo(self, group: int, record: StepRecord, run: Callable[[dict], object]) -> None:
        """`run` over each range's kernel arguments of `record`, on current host state."""
        tensors = self.states(group)
        for call in self._share.kernel_args(group, tensors, record):
            run(call)
        self._share.changed(group, tensors)

    def commit(self, group: int) -> None:
        pass

    def request_read(self, group: int) -> None:
        raise RuntimeError("optimizer states are in host memory: no reads or writes")

    def request_write(self, group: int) -> None:
        self.request_read(group)

    def skip(self, group: int) -> None:
        pass  # nothing waits for a step in host memory

    def reserve(self, group: int) -> None:
        pass

    def release(self, group: int) -> None:
        pass


class DiskStorage:
    """p, m, v in a state file: a step runs on the window buffer the program's read
    filled (READ/WRITE_OPTIMIZER_STATES), rollbacks and corrections on the file's scratch
    buffer. `exact`: a rollback returns to the committed version rather than running the
    inverse."""

    def __init__(self, params: Sequence[torch.Tensor], disk: DiskStates, kernel: AdamKernel,
                 share: SubgroupShare, exact: bool) -> None:
        self.disk, self._kernel, self._share, self._exact = disk, kernel, share, exact
        for group, p in enumerate(params):
            disk.write_committed(group, p.detach())

    def states(self, group: int) -> GroupTensors:
        return self.disk.committed_views(group)

    def load(self, group: int, p: torch.Tensor, m: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> None:
        self.disk.write_committed(group, p, m, v)

    def host_bytes(self) -> int:
        return self.disk.host_bytes

    def step(self, group: int, run: StepRun) -> tuple[bool, float]:
        finite, ran = False, False
        try:
            finite, sq = run(self.disk.resident(group))
            ran = True
        finally:  # the write goes on (or gives the buffer back) either way
            # Without exact rollbacks a non-finite step leaves what the kernel's inverse
            # made of its partial update, as in host memory: that is the state to keep.
            self.disk.stepped(group, bool(finite) or (ran and not self._exact))
        return finite, sq

    def rollback(self, group: int, record: StepRecord) -> None:
        if not self._exact:  # the inverse, on the staged state, as in host memory
            self._on_staged(group, record, lambda call: self._kernel.undo(call))
            return
        self.disk.wait_written(group)  # the committed version is the state before the step
        self.disk.versions.discard(group)
        if record.out is not None:  # the working copy a step writes: p rounded
            out = record.out.reshape(-1)
            self.disk.each_chunk(group, lambda lo, hi, tensors: out[lo:hi].copy_(tensors[0]))

    def correct(self, group: int, record: StepRecord, corrected: StepRecord) -> None:
        if not self._exact:  # inverse and step again on the staged state, as in host memory
            self._on_staged(group, corrected,
                            lambda call: self._kernel.correct(call, record.clip))
            return

        def step(call: dict) -> None:
            finite, _ = self._kernel.step(call)
            if not finite:
                raise RuntimeError(f"group {group}: gradient became non-finite after its step")
        # the same step again, from the committed state, on the kernel for every subgroup
        # (what a correction in memory does): its staged bytes are rewritten
        self.disk.wait_written(group)
        self._over_chunks(group, corrected, step, staged=False)

    def _on_staged(self, group: int, record: StepRecord, run: Callable[[dict], object]) -> None:
        """`run` over each range's kernel arguments of `record` on the group's staged state,
        which is then staged again."""
        self.disk.wait_written(group)  # the step's staged bytes are read, then rewritten
        self._over_chunks(group, record, run, staged=True)

    def _over_chunks(self, group: int, record: StepRecord, run: Callable[[dict], object],
                     staged: bool) -> None:
        """`run` over the kernel arguments of `record`, a chunk of the group at a time in
        the scratch buffer (read from the committed version, or the staged one when
        `staged`), each chunk written back as the staged version."""
        def chunk(lo: int, hi: int, tensors: GroupTensors) -> None:
            for call in self._share.kernel_args(group, tensors, record, span=(lo, hi)):
                run(call)
        self.disk.each_chunk(group, chunk, staged=staged, stage=True)

    def commit(self, group: int) -> None:
        """The staged state becomes the committed one."""
        self.disk.versions.commit(group)

    def request_read(self, group: int) -> None:
        self.disk.request_read(group)

    def request_write(self, group: int) -> None:
        self.disk.request_write(group)

    def skip(self, group: int) -> None:
        """Not stepped this iteration (an overflow verdict came first)."""
        self.disk.stepped(group, False)

    def reserve(self, group: int) -> None:
        self.disk.versions.reserve(group)

    def release(self, group: int) -> None:
        self.disk.versions.release(group)
