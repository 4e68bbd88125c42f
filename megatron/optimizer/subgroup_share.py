"""The device's share of CPUAdamW's groups (Deep Optimizer States): per group, the
subgroups it is stepped in (megatron/optimizer/subgroups.py plans them), the device updater
that steps those marked on_device, and the step that runs both shares at once
(Algorithm 1). A group not split is stepped by the kernel in one piece. This part also
says which element ranges a group's kernel calls cover (one per subgroup, else the whole
group), for steps, rollbacks and corrections alike."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from megatron.optimizer.adam_kernel import AdamKernel, GroupTensors, StepRecord
from megatron.optimizer.rounding import StateFormat
from megatron.optimizer.step_ledger import StepLedger
from megatron.optimizer.subgroups import AdamHyper, DeviceUpdater, Subgroup, SubgroupUpdate


def _part(tensors: GroupTensors, s: Subgroup) -> GroupTensors:
    p, m, v = tensors
    return p[s.lo:s.hi], m[s.lo:s.hi], v[s.lo:s.hi]


class SubgroupShare:
    """cpu_done_s / device_done_s: perf_counter() when the latest step's CPU part / device
    part finished (metrics: between the two only the device worked)."""

    def __init__(self, numels: Sequence[int], kernel: AdamKernel, ledger: StepLedger) -> None:
        self._numel = list(numels)
        self._kernel, self._ledger = kernel, ledger
        self._subgroups: list[tuple[Subgroup, ...] | None] = [None] * len(self._numel)
        self._device: DeviceUpdater | None = None
        self.cpu_done_s = 0.0
        self.device_done_s = 0.0

    def set(self, group: int, subgroups: Sequence[Subgroup] | None,
            device: DeviceUpdater | None = None) -> None:
        """Step `group` in these subgroups from now on (None: in one piece); they must tile
        it, and the group must have no pending update."""
        if self._ledger.has_update(group):
            raise RuntimeError(f"group {group} has an update pending; commit it first")
        if subgroups is not None:
            n = self._numel[group]
            ends = [(s.lo, s.hi) for s in subgroups]
            if not ends or ends[0][0] != 0 or ends[-1][1] != n or any(
                    a[1] != b[0] or a[0] >= a[1] for a, b in zip(ends, ends[1:])):
                raise ValueError(f"subgroups {ends} do not tile group {group} of {n} elements")
            if any(s.on_device for s in subgroups):
                if device is None and self._device is None:
                    raise ValueError("device subgroups need a device updater")
        if device is not None:
            self._device = device
        self._subgroups[group] = tuple(subgroups) if subgroups is not None else None

    def of(self, group: int) -> tuple[Subgroup, ...] | None:
        return self._subgroups[group]

    def kernel_args(self, group: int, tensors: GroupTensors, r: StepRecord,
                    on_device: bool | None = None,
                    span: tuple[int, int] | None = None) -> list[dict]:
        """Kernel arguments per subgroup (each with its own snapshot block), or the whole
        group's when it is not split; on_device=False: only the CPU subgroups. `span`:
        only elements [lo, hi) of the group, which `tensors` hold (a chunk read from
        disk, where no snapshots are kept)."""
        subgroups = self._subgroups[group]
        if span is not None:
            if self._ledger.snapshot(group) is not None:
                raise RuntimeError(f"group {group}: a chunk of a group with snapshots")
            lo, hi = span
            ranges = [(0, self._numel[group])] if subgroups is None else [
                (s.lo, s.hi) for s in subgroups if on_device is None or s.on_device == on_device]
            return [self._kernel.args(group, tensors, r, max(a, lo), min(b, hi), None, base=lo)
                    for a, b in ranges if max(a, lo) < min(b, hi)]
        if subgroups is None:
            return [self._kernel.args(group, tensors, r, 0, self._numel[group],
                                      self._ledger.snapshot(group))]
        return [self._kernel.args(group, tensors, r, s.lo, s.hi,
                                  self._ledger.snapshot(group, s.lo, s.hi))
                for s in subgroups if on_device is None or s.on_device == on_device]

    def step(self, group: int, tensors: GroupTensors, r: StepRecord) -> tuple[bool, float]:
        """One step of the group: (finite, sum of squares of the unscaled gradient)."""
        if self._subgroups[group] is None:
            finite, sq = self._kernel.step(self.kernel_args(group, tensors, r)[0])
            self.cpu_done_s = max(self.cpu_done_s, time.perf_counter())
            return finite, sq
        return self._step_subgroups(group, tensors, r)

    def _step_subgroups(self, group: int, tensors: GroupTensors,
                        r: StepRecord) -> tuple[bool, float]:
        """Algorithm 1: the device subgroups are launched first (their copies and updates
        queue on the device's streams), the CPU steps the others meanwhile; then the
        device's flushes are awaited. A non-finite gradient anywhere leaves the whole group
        as it was (the subgroups that did update are undone)."""
        subgroups = self._subgroups[group] or ()
        launched = [(s, self._launch(group, tensors, r, s)) for s in subgroups if s.on_device]
        results = []
        for s, call in zip([s for s in subgroups if not s.on_device],
                           self.kernel_args(group, tensors, r, on_device=False)):
            results.append((s, *self._kernel.step(call)))
        self.cpu_done_s = max(self.cpu_done_s, time.perf_counter())
        results += [(s, *update.result()) for s, update in launched]
        if launched:
            self.device_done_s = max(self.device_done_s, time.perf_counter())
        if all(finite for _, finite, _ in results):
            return True, sum(sq for _, _, sq in results)
        self.to_host(group, tensors)
        updated = {s for s, finite, _ in results if finite}
        for s, call in zip(subgroups, self.kernel_args(group, tensors, r)):
            if s in updated:
                self._kernel.undo(call)
        self.changed(group, tensors)
        return False, math.inf

    def _launch(self, group: int, tensors: GroupTensors, r: StepRecord,
                s: Subgroup) -> SubgroupUpdate:
        """Start the device's step of subgroup `s` (in exact mode, after snapshotting its
        pre-step state as the kernel keeps it)."""
        k = self._kernel
        part = _part(tensors, s)
        if self._ledger.snapshot(group) is not None:
            self._device.to_host(*part)
            dtypes = (k.master_dtype, k.state_dtype, k.state_dtype)
            for saved, state in zip(self._ledger.snapshot_parts(group, s.lo, s.hi, dtypes), part):
                saved.copy_(state)
        hyper = AdamHyper.of(r.lr, k.betas, k.eps, r.weight_decay, r.step, r.inv_scale, r.clip)
        rows = k.rounding_rows(group, s.lo, s.hi, r.step)
        fmt = StateFormat(k.master_dtype, k.state_dtype,
                          None if rows is None else torch.tensor(rows, dtype=torch.int64))
        out = None if r.out is None else r.out[s.lo:s.hi]
        return self._device.launch(*part, r.grad[s.lo:s.hi], out, hyper, fmt)

    def to_host(self, group: int, tensors: GroupTensors) -> None:
        """Make the host's p, m, v of the group current (a resident updater keeps them)."""
        for s in self._device_ranges(group):
            self._device.to_host(*_part(tensors, s))

    def changed(self, group: int, tensors: GroupTensors) -> None:
        """The host changed the group's p, m, v: the device drops its copies."""
        for s in self._device_ranges(group):
            self._device.forget(tensors[0][s.lo:s.hi])

    def _device_ranges(self, group: int) -> list[Subgroup]:
        return [s for s in self._subgroups[group] or () if s.on_device]
