"""CPUAdamW: master weights and Adam moments (fp32, or bf16 with the arithmetic in fp32)
for flat parameter groups, stepped by the C++ kernel (csrc/, bound as megatron.optimizer._cpu_adam).

A group is a flat run of parameters with its own fp32 master, m and v (the pipeline gives each backward stage two: weight-decayed elements, then the others). A step reads the group's gradient (fp32, fp16 or bf16),
unscales it, checks it, applies AdamW and writes the working copy (bf16, fp16 or fp32)
in one pass over memory. A group whose gradient holds a non-finite value is left as it
was. A group that was updated can be rolled back: by the arithmetic inverse of AdamW
(default, no extra memory, error bound in docs/cpu_optimizer.md) or, with
`exact_rollback=True`, from a snapshot the step takes of the state it changes
(as many bytes per parameter again as p, m and v take: 12 in fp32, 6 all in bf16;
bit-exact). With `disk=` the states live in a file instead (disk_states.py): a group is in
host memory only between its read and its write. Where the states live never changes the
numbers: on disk, `exact_rollback=True` costs no snapshot (the file keeps the committed
version), and without it rollbacks and corrections run the same arithmetic inverse on the
staged state as in host memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

try:
    from megatron.optimizer import _cpu_adam as _kernel
    from megatron.optimizer.worker_pool import shared_pool
except ImportError as error:  # the extension is built in place by `make setup`
    if "CPU_ADAM_" in str(error):  # built, but a tuning variable is invalid
        raise ImportError(f"the CPU optimizer's tuning environment is invalid: {error}") from error
    raise ImportError(
        "megatron.optimizer._cpu_adam is not built: run `python setup.py build_ext --inplace` "
        f"(or `make setup`) in the repository root ({error})"
    ) from error

from megatron.optimizer.disk_states import DiskStates  # noqa: E402
from megatron.optimizer.rounding import (  # noqa: E402
    ElementRun,
    StateFormat,
    kernel_runs,
    state_bytes_per_param,
)
from megatron.optimizer.subgroups import AdamHyper, DeviceUpdater, Subgroup  # noqa: E402

_DTYPE_CODES = {torch.float32: _kernel.F32, torch.float16: _kernel.F16, torch.bfloat16: _kernel.BF16}


@dataclass(frozen=True)
class GroupStepResult:
    """What one group's step did: `updated` is False when its gradient was not finite."""

    group: int
    updated: bool
    grad_sq_sum: float  # sum of squares of the unscaled gradient (inf when not finite)


@dataclass(frozen=True)
class _StepRecord:
    """Everything the inverse of a step needs; the gradient must not change until then."""

    grad: torch.Tensor
    out: torch.Tensor | None
    inv_scale: float
    lr: float
    weight_decay: float
    step: int
    clip: float = 1.0  # gradient clip factor the step used (after the unscaling)


def available_isas() -> list[str]:
    """Kernels this CPU can run, least to most capable; 'auto' picks the last."""
    return list(_kernel.available_isas())


def kernel_tuning_setting() -> dict:
    """The kernel's speed knobs: prefetch (elements ahead, 0: none), stream_out
    (non-temporal stores of the working copy), block (elements per thread block). They
    start from CPU_ADAM_PREFETCH, CPU_ADAM_STREAM_OUT, CPU_ADAM_BLOCK; results never
    depend on them."""
    return dict(_kernel.get_tuning())


@contextlib.contextmanager
def kernel_tuning(prefetch: int | None = None, stream_out: bool | None = None,
                  block: int | None = None) -> Iterator[dict]:
    """Run the enclosed kernel calls with these knobs (None: unchanged), then restore
    the previous ones. Process-wide: meant for benchmarks, not for concurrent steps."""
    previous = _kernel.set_tuning(prefetch=prefetch, stream_out=stream_out, block=block)
    try:
        yield kernel_tuning_setting()
    finally:
        _kernel.set_tuning(**previous)


def usable_cores() -> list[int]:
    """The cores this process may run on (what `cores=` may name)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _check_flat(name: str, tensor: torch.Tensor, numel: int, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be in host memory, got device {tensor.device}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {names}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")


def check_gradient(
    grad: torch.Tensor,
    inv_scale: float = 1.0,
    threads: int = 1,
    isa: str = "auto",
    cores: Sequence[int] = (),
) -> tuple[bool, float]:
    """Unscale and check a flat gradient without updating anything (the synchronous
    schedule's first pass). Returns (finite, sum of squares of the unscaled gradient)."""
    _check_flat("grad", grad, grad.numel(), list(_DTYPE_CODES))
    return _kernel.check(
        grad=grad.data_ptr(), grad_dtype=_DTYPE_CODES[grad.dtype], n=grad.numel(),
        inv_scale=float(inv_scale), pool=shared_pool(int(threads), cores), isa=isa,
    )


def _check_clip(clip: float) -> None:
    if not 0.0 < clip <= 1.0:
        raise ValueError(f"clip={clip} must lie in (0, 1]")


class CPUAdamW:
    """AdamW (decoupled weight decay, bias correction; torch.optim.AdamW's arithmetic)
    over flat groups held in host memory.

    params: one flat tensor per group, copied into the masters (master_dtype).
    threads: kernel threads per step (default: all usable cores), from the process's
        persistent pool for (threads, cores), shared with every optimizer so configured.
    cores: pin the kernel threads to these cores (thread i -> cores[i % len]).
    exact_rollback: snapshot the state each step changes so rollback is bit-exact
        (the snapshot holds p, m, v in their own dtypes).
    state_dtype: float32 or bfloat16 for m and v (bf16 rounds to nearest even).
    master_dtype: float32 or bfloat16 for the master weights; a bf16 master rounds
        stochastically when `stochastic_rounding` (megatron/optimizer/rounding.py: the
        random bits are a function of rounding_seed, the element's parameter and index in
        it, and the step), else to nearest even.
    element_runs: per group, ElementRuns tiling it: which parameter (and which index in
        it) each element is, so that the rounding does not depend on the group layout.
        Default: group i is parameter i.
    disk: keep p, m, v in this state file (created for these groups' sizes and dtypes)
        rather than in host memory; each step then needs the program's read
        (request_read) before it and its write (request_write) after it.
    weight_decay_mults: per group, a factor on weight_decay (0 for a no-decay group).
    isa: 'auto' or one of available_isas().

    Steps of different groups may run concurrently from different threads; steps of one
    group must not.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        threads: int | None = None,
        cores: Sequence[int] | None = None,
        exact_rollback: bool = False,
        isa: str = "auto",
        weight_decay_mults: Sequence[float] | None = None,
        state_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = True,
        rounding_seed: int = 0,
        element_runs: Sequence[Sequence[ElementRun]] | None = None,
        disk: DiskStates | None = None,
    ) -> None:
        for name, dtype in (("state_dtype", state_dtype), ("master_dtype", master_dtype)):
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name}={dtype}; expected torch.float32 or torch.bfloat16")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 < betas[1] < 1.0:
            raise ValueError(f"betas={betas} must lie in [0, 1) and (0, 1)")
        if betas[0] == 0.0:
            raise ValueError("betas[0]=0.0 makes the step irreversible; expected 0 < beta1 < 1")
        if eps <= 0.0:
            raise ValueError(f"eps={eps} must be > 0")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if isa != "auto" and isa not in available_isas():
            raise ValueError(f"isa={isa!r} is not available; expected auto or one of {available_isas()}")
        usable = usable_cores()
        self.threads = len(usable) if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        self.cores = [int(c) for c in cores] if cores else []
        bad = [c for c in self.cores if c not in usable]
        if bad:
            raise ValueError(f"cores={list(cores or [])}: {bad} not usable by this process; usable: {usable}")
        mults = [1.0] * len(params) if weight_decay_mults is None else list(weight_decay_mults)
        if len(mults) != len(params) or any(m < 0 for m in mults):
            raise ValueError(f"weight_decay_mults={weight_decay_mults}: expected one value >= 0 "
                             f"per group ({len(params)})")
        # Per group, e.g. 0 for norm weights (Megatron's no-decay group).
        self.weight_decay_mults = [float(m) for m in mults]
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.exact_rollback = bool(exact_rollback)
        self.isa = isa
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.rounding_seed = int(rounding_seed)
        if element_runs is None:
            element_runs = [[ElementRun(0, p.numel(), i)] for i, p in enumerate(params)]
        if len(element_runs) != len(params):
            raise ValueError(f"element_runs has {len(element_runs)} entries; expected one "
                             f"per group ({len(params)})")
        self._runs = [tuple(runs) for runs in element_runs]
        self._pool = shared_pool(self.threads, self.cores)
        self._master: list[torch.Tensor] = []
        self._exp_avg: list[torch.Tensor] = []
        self._exp_avg_sq: list[torch.Tensor] = []
        self._snapshot: list[torch.Tensor | None] = []
        self._steps: list[int] = []
        self._last: list[_StepRecord | None] = []
        self._numel: list[int] = []
        self.disk = disk
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.device.type != "cpu":
                raise ValueError(f"params[{i}] must be a flat (1-D) host tensor")
            n = p.numel()
            self._numel.append(n)
            if disk is not None:
                disk.write_committed(i, p.detach())
                self._master.append(torch.empty(0, dtype=master_dtype))
                self._exp_avg.append(torch.empty(0, dtype=state_dtype))
                self._exp_avg_sq.append(torch.empty(0, dtype=state_dtype))
                self._snapshot.append(None)
            else:
                self._master.append(p.detach().to(master_dtype, copy=True).contiguous())
                self._exp_avg.append(torch.zeros(n, dtype=state_dtype))
                self._exp_avg_sq.append(torch.zeros(n, dtype=state_dtype))
                self._snapshot.append(torch.empty(n * self.bytes_per_param, dtype=torch.uint8)
                                      if exact_rollback else None)
            self._steps.append(0)
            self._last.append(None)
        # Per group: its subgroups when some are updated on the device (set_subgroups).
        self._subgroups: list[tuple[Subgroup, ...] | None] = [None] * len(self._master)
        self._device: DeviceUpdater | None = None
        # perf_counter() when the latest step's CPU part / device part finished (metrics)
        self.cpu_done_s = 0.0
        self.device_done_s = 0.0

    # --- state -------------------------------------------------------------------------

    @property
    def bytes_per_param(self) -> int:
        """Host bytes per parameter of p, m and v (the snapshot, when kept, as many)."""
        return state_bytes_per_param(self.master_dtype, self.state_dtype)

    @property
    def num_groups(self) -> int:
        return len(self._master)

    def master(self, group: int) -> torch.Tensor:
        """The group's master (on disk: a view of the committed one, see states())."""
        return self.states(group)[0]

    def exp_avg(self, group: int) -> torch.Tensor:
        return self.states(group)[1]

    def exp_avg_sq(self, group: int) -> torch.Tensor:
        return self.states(group)[2]

    def states(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """p, m, v of the group: live buffers in host memory; on disk, views of the
        committed state in the mapped file (valid until the group's next commit)."""
        i = self._index(group)
        if self.disk is not None:
            return self.disk.committed_views(i)
        self._host_state(i)
        return self._master[i], self._exp_avg[i], self._exp_avg_sq[i]

    def host_state_bytes(self) -> int:
        """Host bytes this optimizer holds for p, m, v (and snapshots): on disk, the
        window's and the scratch buffer's."""
        if self.disk is not None:
            return self.disk.host_bytes
        tensors = [*self._master, *self._exp_avg, *self._exp_avg_sq,
                   *(s for s in self._snapshot if s is not None)]
        return sum(t.nbytes for t in tensors)

    # --- states on disk: the program's reads and writes ----------------------------------

    def request_read(self, group: int) -> None:
        """READ_OPTIMIZER_STATES of a group kept on disk (returns at once)."""
        self._on_disk().request_read(self._index(group))

    def request_write(self, group: int) -> None:
        """WRITE_OPTIMIZER_STATES: the group's step result goes to the file (at once)."""
        i = self._index(group)
        self._on_disk().request_write(i, lambda: self._map(i, None))

    def skip(self, group: int) -> None:
        """The group is not stepped this iteration (an overflow verdict came first)."""
        if self.disk is not None:
            self.disk.stepped(self._index(group), False)

    def reserve(self, group: int) -> None:
        """A rollback or correction of `group` will run: its next read waits for it."""
        if self.disk is not None:
            self.disk.reserve(self._index(group))

    def release(self, group: int) -> None:
        if self.disk is not None:
            self.disk.release(self._index(group))

    def _on_disk(self) -> DiskStates:
        if self.disk is None:
            raise RuntimeError("optimizer states are in host memory: no reads or writes")
        return self.disk

    def _map(self, i: int, views: tuple[torch.Tensor, ...] | None) -> None:
        """Point group i's p, m, v at a buffer holding them (None: at nothing)."""
        if views is None:
            views = (torch.empty(0, dtype=self.master_dtype),
                     torch.empty(0, dtype=self.state_dtype), torch.empty(0, dtype=self.state_dtype))
        self._master[i], self._exp_avg[i], self._exp_avg_sq[i] = views

    def step_count(self, group: int) -> int:
        return self._steps[self._index(group)]

    def state_dict(self) -> dict:
        """Checkpointable state (tensors are the live buffers: copy before mutating)."""
        return {
            "hyper": {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                      "weight_decay": self.weight_decay},
            "groups": [
                {"master": p, "exp_avg": m, "exp_avg_sq": v, "step": t}
                for (p, m, v), t in zip(map(self.states, range(self.num_groups)), self._steps)
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Copies the state in; fp32 or bf16 tensors either way: fp32 into a bf16 state
        rounds to nearest even once, bf16 into fp32 widens exactly."""
        groups = state["groups"]
        if len(groups) != self.num_groups:
            raise ValueError(f"state has {len(groups)} groups; this optimizer has {self.num_groups}")
        for i, s in enumerate(groups):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                _check_flat(f"groups[{i}][{key!r}]", s[key], self._numel[i],
                            [torch.float32, torch.bfloat16])
            if self.disk is not None:
                self.disk.write_committed(i, s["master"], s["exp_avg"], s["exp_avg_sq"])
                self._steps[i] = int(s["step"])
                self._last[i] = None
                continue
            self._master[i].copy_(s["master"])
            self._exp_avg[i].copy_(s["exp_avg"])
            self._exp_avg_sq[i].copy_(s["exp_avg_sq"])
            self._steps[i] = int(s["step"])
            self._last[i] = None
            self._host_changed(i)
        hyper = state.get("hyper", {})
        self.lr = float(hyper.get("lr", self.lr))
        self.weight_decay = float(hyper.get("weight_decay", self.weight_decay))

    # --- steps -------------------------------------------------------------------------

    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        *,
        inv_scale: float = 1.0,
        out: torch.Tensor | None = None,
        clip: float = 1.0,
    ) -> GroupStepResult:
        """One AdamW step of `group` with (grad * inv_scale) * clip; writes the updated
        parameters into `out` (bf16, fp16 or fp32) when given. Leaves the group unchanged
        when the unscaled gradient is not finite. The returned sum of squares is of the
        unscaled, unclipped gradient. Keep `grad` and `out` untouched until the step is
        committed or rolled back."""
        i = self.check_inputs(group, grad, out)
        if not inv_scale > 0.0:
            raise ValueError(f"inv_scale={inv_scale} must be > 0")
        _check_clip(clip)
        weight_decay = self.weight_decay * self.weight_decay_mults[i]
        if not 0.0 <= self.lr * weight_decay < 1.0:  # 1 - lr*wd divides in the inverse
            raise ValueError(f"lr*weight_decay={self.lr * weight_decay} for group {i} must lie in [0, 1)")
        record = _StepRecord(grad, out, float(inv_scale), self.lr, weight_decay,
                             self._steps[i] + 1, float(clip))
        if self.disk is None:
            finite, sq = self._run_step(i, record)
        else:
            finite, ran = False, False
            try:
                self._map(i, self.disk.resident(i))
                finite, sq = self._run_step(i, record)
                ran = True
            finally:  # the write goes on (or gives the buffer back) either way
                # Without exact rollbacks a non-finite step leaves what the kernel's inverse
                # made of its partial update, as in host memory: that is the state to keep.
                self.disk.stepped(i, bool(finite) or (ran and not self.exact_rollback))
        if finite:
            self._steps[i] = record.step
            self._last[i] = record
        else:
            self._last[i] = None
        return GroupStepResult(group=i, updated=bool(finite), grad_sq_sum=float(sq))

    def _run_step(self, i: int, record: _StepRecord) -> tuple[bool, float]:
        if self._subgroups[i] is not None:
            return self._step_subgroups(i, record)
        finite, sq = _kernel.step(**self._kernel_args(i, record))
        self.cpu_done_s = max(self.cpu_done_s, time.perf_counter())
        return finite, sq

    def check_inputs(self, group: int, grad: torch.Tensor, out: torch.Tensor | None = None) -> int:
        """Raises a one-line error unless grad (and out) fit the group; returns its index."""
        i = self._index(group)
        n = self._numel[i]
        _check_flat("grad", grad, n, list(_DTYPE_CODES))
        if out is not None:
            _check_flat("out", out, n, list(_DTYPE_CODES))
        return i

    def rollback_group(self, group: int) -> None:
        """Undo the group's last update (p, m, v, the step count and the working copy)."""
        i = self._index(group)
        record = self._last[i]
        if record is None:
            raise RuntimeError(f"group {i} has no update to roll back")
        if self.disk is not None and self.exact_rollback:  # the committed version is the
            self.disk.wait_written(i)  # state before the step
            self.disk.discard(i)
            if record.out is not None:
                with self.disk.scratch(i) as (p, _, _):
                    record.out.copy_(p)  # the working copy a step writes: p rounded
            self._steps[i] = record.step - 1
            self._last[i] = None
            return
        if self.disk is not None:  # the inverse, on the staged state, as in host memory
            self._on_staged(i, record, lambda args: _kernel.undo(**args))
            self._steps[i] = record.step - 1
            self._last[i] = None
            return
        self._host_state(i)
        for args in self._range_args(i, record):
            _kernel.undo(**args)
        self._host_changed(i)
        self._steps[i] = record.step - 1
        self._last[i] = None

    def correct_group(self, group: int, clip: float) -> None:
        """Replace the group's last update by the same step with clip factor `clip`, in one
        pass over p, m, v and the gradient (the pre-step state comes from the snapshot in
        exact mode, bit-exact; otherwise from the arithmetic inverse, within the bound of
        docs/cpu_optimizer.md, "Clipping corrections"). The working copy is rewritten."""
        i = self._index(group)
        record = self._last[i]
        if record is None:
            raise RuntimeError(f"group {i} has no update to correct")
        _check_clip(clip)
        corrected = replace(record, clip=float(clip))
        if self.disk is not None and not self.exact_rollback:  # inverse and step again on
            self._on_staged(i, corrected,  # the staged state, as in host memory
                            lambda args: _kernel.correct(**args, undo_clip=record.clip))
            self._last[i] = corrected
            return
        if self.disk is not None:  # the same step again, from the committed state
            self.disk.wait_written(i)  # its staged bytes are rewritten
            scratch = self.disk.scratch(i)
            with scratch as views:
                self._map(i, views)
                try:  # on the kernel, every subgroup: what a correction in memory does
                    for args in self._range_args(i, corrected):
                        finite, _ = _kernel.step(**args)
                        if not finite:
                            raise RuntimeError(f"group {i}: gradient became non-finite "
                                               "after its step")
                    scratch.stage()
                finally:
                    self._map(i, None)
            self._last[i] = corrected
            return
        self._host_state(i)
        for args in self._range_args(i, corrected):
            _kernel.correct(**args, undo_clip=record.clip)
        self._host_changed(i)
        self._last[i] = corrected

    def _on_staged(self, i: int, record: _StepRecord, run: Callable[[dict], object]) -> None:
        """`run` over each range's kernel arguments of `record` with group i's staged state
        read into the scratch buffer, which is then staged again."""
        self.disk.wait_written(i)  # the step's staged bytes are read, then rewritten
        scratch = self.disk.scratch(i, staged=True)
        with scratch as views:
            self._map(i, views)
            try:
                for args in self._range_args(i, record):
                    run(args)
                scratch.stage()
            finally:
                self._map(i, None)

    def commit_group(self, group: int) -> None:
        """Forget the group's last update (its gradient may be reused from now on); on
        disk, its staged state becomes the committed one."""
        i = self._index(group)
        if self.disk is not None:
            self.disk.commit(i)
        self._last[i] = None

    def has_update(self, group: int) -> bool:
        return self._last[self._index(group)] is not None

    # --- subgroups (Deep Optimizer States) ----------------------------------------------

    def set_subgroups(self, group: int, subgroups: Sequence[Subgroup] | None,
                      device: DeviceUpdater | None = None) -> None:
        """Step `group` in these subgroups from now on (None: in one piece): those marked
        on_device through `device`, the others with the kernel, concurrently. Rollbacks
        and corrections run on the kernel over the host state, per subgroup (the device
        flushes p, m, v back before its step counts as done). The group must have no
        pending update."""
        i = self._index(group)
        if self._last[i] is not None:
            raise RuntimeError(f"group {i} has an update pending; commit it first")
        if subgroups is not None:
            n = self._numel[i]
            ends = [(s.lo, s.hi) for s in subgroups]
            if not ends or ends[0][0] != 0 or ends[-1][1] != n or any(
                    a[1] != b[0] or a[0] >= a[1] for a, b in zip(ends, ends[1:])):
                raise ValueError(f"subgroups {ends} do not tile group {i} of {n} elements")
            if any(s.on_device for s in subgroups):
                if device is None and self._device is None:
                    raise ValueError("device subgroups need a device updater")
        if device is not None:
            self._device = device
        self._subgroups[i] = tuple(subgroups) if subgroups is not None else None

    def subgroups(self, group: int) -> tuple[Subgroup, ...] | None:
        return self._subgroups[self._index(group)]

    def _step_subgroups(self, i: int, r: _StepRecord) -> tuple[bool, float]:
        """Algorithm 1: the device subgroups are launched first (their copies and updates
        queue on the device's streams), the CPU steps the others meanwhile; then the
        device's flushes are awaited. A non-finite gradient anywhere leaves the whole group
        as it was (the subgroups that did update are undone)."""
        subgroups = self._subgroups[i] or ()
        hyper = AdamHyper.of(r.lr, self.betas, self.eps, r.weight_decay, r.step,
                             r.inv_scale, r.clip)
        snap = self._snapshot[i]
        launched = []
        for s in subgroups:
            if s.on_device:
                if snap is not None:  # exact mode: the pre-step state, as the kernel keeps it
                    self._device.to_host(self._master[i][s.lo:s.hi], self._exp_avg[i][s.lo:s.hi],
                                         self._exp_avg_sq[i][s.lo:s.hi])
                    for part, state in zip(self._snapshot_parts(i, s.lo, s.hi),
                                           (self._master[i], self._exp_avg[i],
                                            self._exp_avg_sq[i])):
                        part.copy_(state[s.lo:s.hi])
                out = None if r.out is None else r.out[s.lo:s.hi]
                rows = self._rounding_rows(i, s.lo, s.hi, r.step)
                fmt = StateFormat(self.master_dtype, self.state_dtype,
                                  None if rows is None else torch.tensor(rows, dtype=torch.int64))
                launched.append((s, self._device.launch(
                    self._master[i][s.lo:s.hi], self._exp_avg[i][s.lo:s.hi],
                    self._exp_avg_sq[i][s.lo:s.hi], r.grad[s.lo:s.hi], out, hyper, fmt)))
        results = []
        for s, args in zip([s for s in subgroups if not s.on_device],
                           self._range_args(i, r, on_device=False)):
            results.append((s, *_kernel.step(**args)))
        self.cpu_done_s = max(self.cpu_done_s, time.perf_counter())
        results += [(s, *update.result()) for s, update in launched]
        if launched:
            self.device_done_s = max(self.device_done_s, time.perf_counter())
        if all(finite for _, finite, _ in results):
            return True, sum(sq for _, _, sq in results)
        self._host_state(i)
        updated = {s for s, finite, _ in results if finite}
        for s, args in zip(subgroups, self._range_args(i, r)):
            if s in updated:
                _kernel.undo(**args)
        self._host_changed(i)
        return False, math.inf

    def _device_ranges(self, i: int) -> list[Subgroup]:
        return [s for s in self._subgroups[i] or () if s.on_device]

    def _host_state(self, i: int) -> int:
        """Make the host's p, m, v of group i current (a resident updater keeps them)."""
        for s in self._device_ranges(i):
            self._device.to_host(self._master[i][s.lo:s.hi], self._exp_avg[i][s.lo:s.hi],
                                 self._exp_avg_sq[i][s.lo:s.hi])
        return i

    def _host_changed(self, i: int) -> None:
        for s in self._device_ranges(i):
            self._device.forget(self._master[i][s.lo:s.hi])

    def _range_args(self, i: int, r: _StepRecord, on_device: bool | None = None) -> list[dict]:
        """Kernel arguments per subgroup (each with its own snapshot block), or the whole
        group's when it is not split; on_device=False: only the CPU subgroups."""
        whole = self._kernel_args(i, r)
        subgroups = self._subgroups[i]
        if subgroups is None:
            return [whole]
        args = []
        for s in subgroups:
            if on_device is not None and s.on_device != on_device:
                continue
            args.append(self._kernel_args(i, r, s.lo, s.hi, self._snapshot_block(i, s.lo, s.hi)))
        return args

    def _snapshot_block(self, i: int, lo: int, hi: int) -> torch.Tensor | None:
        """The bytes of group i's snapshot that hold elements [lo, hi): [p | m | v]."""
        snap = self._snapshot[i]
        return None if snap is None else snap[lo * self.bytes_per_param:hi * self.bytes_per_param]

    def _snapshot_parts(self, i: int, lo: int, hi: int) -> list[torch.Tensor]:
        """p, m, v of the snapshot block of elements [lo, hi), as typed views."""
        block, width, parts, at = self._snapshot_block(i, lo, hi), hi - lo, [], 0
        for dtype in (self.master_dtype, self.state_dtype, self.state_dtype):
            size = width * dtype.itemsize
            parts.append(block[at:at + size].view(dtype))
            at += size
        return parts

    def _rounding_rows(self, i: int, lo: int, hi: int, step: int) -> list[list[int]] | None:
        """The kernel's stochastic-rounding rows for elements [lo, hi) of group i."""
        if self.master_dtype != torch.bfloat16 or not self.stochastic_rounding:
            return None
        return kernel_runs(self._runs[i], lo, hi, self.rounding_seed, step)

    def _kernel_args(self, i: int, r: _StepRecord, lo: int = 0, hi: int | None = None,
                     snap: torch.Tensor | None = None) -> dict:
        if hi is None:
            hi, snap = self._numel[i], self._snapshot[i]
        fmt = _kernel.StateFormat()
        fmt.master_dtype = _DTYPE_CODES[self.master_dtype]
        fmt.state_dtype = _DTYPE_CODES[self.state_dtype]
        fmt.runs = self._rounding_rows(i, lo, hi, r.step) or []

        def at(t: torch.Tensor) -> int:
            return t.data_ptr() + lo * t.element_size()
        return dict(
            p=at(self._master[i]), m=at(self._exp_avg[i]),
            v=at(self._exp_avg_sq[i]), grad=at(r.grad),
            grad_dtype=_DTYPE_CODES[r.grad.dtype],
            out=0 if r.out is None else at(r.out),
            out_dtype=_kernel.NONE if r.out is None else _DTYPE_CODES[r.out.dtype],
            snapshot=0 if snap is None else snap.data_ptr(), n=hi - lo,
            lr=r.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
            weight_decay=r.weight_decay, step=r.step, inv_scale=r.inv_scale,
            pool=self._pool, isa=self.isa, clip=r.clip, format=fmt,
        )

    def _index(self, group: int) -> int:
        if not 0 <= group < len(self._master):
            raise IndexError(f"group={group} out of range; this optimizer has {len(self._master)} groups")
        return group
