"""CPUAdamW: master weights and Adam moments (fp32, or bf16 with the arithmetic in fp32)
for flat parameter groups, stepped by the C++ kernel (csrc/, bound in adam_kernel.py).

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

CPUAdamW composes four parts, one job each: the kernel binding (adam_kernel.py), the
rollback and speculation bookkeeping (step_ledger.py), the device's share of subgroups
(subgroup_share.py) and the state storage, host memory or NVMe (state_storage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron.optimizer.adam_kernel import (
    DTYPE_CODES,
    AdamKernel,
    GroupTensors,
    StepRecord,
    available_isas,
    check_clip,
    check_flat,
    check_gradient,
    kernel_tuning,
    kernel_tuning_setting,
    usable_cores,
)
from megatron.optimizer.disk_states import DiskStates
from megatron.optimizer.rounding import ElementRun, state_bytes_per_param
from megatron.optimizer.state_storage import DiskStorage, HostStorage, StateStorage
from megatron.optimizer.step_ledger import StepLedger
from megatron.optimizer.subgroup_share import SubgroupShare
from megatron.optimizer.subgroups import DeviceUpdater, Subgroup

# What callers import from here (the kernel binding's helpers live in adam_kernel.py).
__all__ = ["CPUAdamW", "GroupStepResult", "available_isas", "check_gradient", "kernel_tuning",
           "kernel_tuning_setting", "usable_cores"]


@dataclass(frozen=True)
class GroupStepResult:
    """What one group's step did: `updated` is False when its gradient was not finite."""

    group: int
    updated: bool
    grad_sq_sum: float  # sum of squares of the unscaled gradient (inf when not finite)


def _check_hyper(betas: tuple[float, float], eps: float, weight_decay: float, isa: str,
                 state_dtype: torch.dtype, master_dtype: torch.dtype) -> None:
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


def _check_threads(threads: int | None, cores: Sequence[int] | None) -> tuple[int, list[int]]:
    """(threads, cores) checked against the cores this process may use."""
    usable = usable_cores()
    count = len(usable) if threads is None else int(threads)
    if count < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    pinned = [int(c) for c in cores] if cores else []
    bad = [c for c in pinned if c not in usable]
    if bad:
        raise ValueError(f"cores={list(cores or [])}: {bad} not usable by this process; usable: {usable}")
    return count, pinned


def _check_groups(params: Sequence[torch.Tensor], weight_decay_mults: Sequence[float] | None,
                  element_runs: Sequence[Sequence[ElementRun]] | None
                  ) -> tuple[list[float], list[Sequence[ElementRun]]]:
    """Per group: its weight decay factor and its element runs (defaults filled in)."""
    mults = [1.0] * len(params) if weight_decay_mults is None else list(weight_decay_mults)
    if len(mults) != len(params) or any(m < 0 for m in mults):
        raise ValueError(f"weight_decay_mults={weight_decay_mults}: expected one value >= 0 "
                         f"per group ({len(params)})")
    if element_runs is None:
        element_runs = [[ElementRun(0, p.numel(), i)] for i, p in enumerate(params)]
    if len(element_runs) != len(params):
        raise ValueError(f"element_runs has {len(element_runs)} entries; expected one "
                         f"per group ({len(params)})")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.device.type != "cpu":
            raise ValueError(f"params[{i}] must be a flat (1-D) host tensor")
    return [float(m) for m in mults], list(element_runs)


class CPUAdamW:
    """AdamW (decoupled weight decay, bias correction; torch.optim.AdamW's arithmetic)
    over flat groups held in host memory.

    params: one flat tensor per group, copied into the masters (master_dtype); with
        `adopt=True` a contiguous one already in master_dtype becomes the master itself
        (the caller gives it up: no second copy of the masters at start-up).
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
        adopt: bool = False,
    ) -> None:
        _check_hyper(betas, eps, weight_decay, isa, state_dtype, master_dtype)
        self.threads, self.cores = _check_threads(threads, cores)
        # Per group, e.g. 0 for norm weights (Megatron's no-decay group).
        self.weight_decay_mults, runs = _check_groups(params, weight_decay_mults, element_runs)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        # Fixed for the optimizer's life: the kernel is bound with them.
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.exact_rollback = bool(exact_rollback)
        self.isa = isa
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.rounding_seed = int(rounding_seed)
        self._numel = [p.numel() for p in params]
        self._kernel = AdamKernel(self.betas, self.eps, master_dtype, state_dtype, runs,
                                  self.stochastic_rounding, self.rounding_seed,
                                  self.threads, self.cores, isa)
        self._pool = self._kernel.pool
        # On disk the file keeps the committed version: no snapshot needed for exactness.
        snapshot = self.bytes_per_param if exact_rollback and disk is None else 0
        self._ledger = StepLedger(self._numel, snapshot)
        self._share = SubgroupShare(self._numel, self._kernel, self._ledger)
        self.disk = disk
        # Where p, m and v live; on disk it also takes the program's reads and writes
        # (READ/WRITE_OPTIMIZER_STATES, skip, and the reserve/release of a correction).
        self.storage: StateStorage = (
            HostStorage(params, self._kernel, self._share, self._ledger, adopt) if disk is None
            else DiskStorage(params, disk, self._kernel, self._share, self.exact_rollback))

    # --- state -------------------------------------------------------------------------

    @property
    def bytes_per_param(self) -> int:
        """Host bytes per parameter of p, m and v (the snapshot, when kept, as many)."""
        return state_bytes_per_param(self.master_dtype, self.state_dtype)

    @property
    def num_groups(self) -> int:
        return len(self._numel)

    def master(self, group: int) -> torch.Tensor:
        """The group's master (on disk: a view of the committed one, see states())."""
        return self.states(group)[0]

    def exp_avg(self, group: int) -> torch.Tensor:
        return self.states(group)[1]

    def exp_avg_sq(self, group: int) -> torch.Tensor:
        return self.states(group)[2]

    def states(self, group: int) -> GroupTensors:
        """p, m, v of the group: live buffers in host memory; on disk, views of the
        committed state in the mapped file (valid until the group's next commit)."""
        return self.storage.states(self._index(group))

    def host_state_bytes(self) -> int:
        """Host bytes this optimizer holds for p, m, v (and snapshots): on disk, the
        window's and the scratch buffer's."""
        return self.storage.host_bytes()

    def step_count(self, group: int) -> int:
        return self._ledger.step_count(self._index(group))

    def state_dict(self) -> dict:
        """Checkpointable state (tensors are the live buffers: copy before mutating)."""
        return {
            "hyper": {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                      "weight_decay": self.weight_decay},
            "groups": [
                {"master": p, "exp_avg": m, "exp_avg_sq": v, "step": self.step_count(g)}
                for g, (p, m, v) in enumerate(map(self.states, range(self.num_groups)))
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
                check_flat(f"groups[{i}][{key!r}]", s[key], self._numel[i],
                           [torch.float32, torch.bfloat16])
            self.storage.load(i, s["master"], s["exp_avg"], s["exp_avg_sq"])
            self._ledger.load(i, int(s["step"]))
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
        check_clip(clip)
        weight_decay = self.weight_decay * self.weight_decay_mults[i]
        if not 0.0 <= self.lr * weight_decay < 1.0:  # 1 - lr*wd divides in the inverse
            raise ValueError(f"lr*weight_decay={self.lr * weight_decay} for group {i} must lie in [0, 1)")
        record = StepRecord(grad, out, float(inv_scale), self.lr, weight_decay,
                            self._ledger.next_step(i), float(clip))
        finite, sq = self.storage.step(i, lambda tensors: self._share.step(i, tensors, record))
        self._ledger.stepped(i, record, bool(finite))
        return GroupStepResult(group=i, updated=bool(finite), grad_sq_sum=float(sq))

    def check_inputs(self, group: int, grad: torch.Tensor, out: torch.Tensor | None = None) -> int:
        """Raises a one-line error unless grad (and out) fit the group; returns its index."""
        i = self._index(group)
        n = self._numel[i]
        check_flat("grad", grad, n, list(DTYPE_CODES))
        if out is not None:
            check_flat("out", out, n, list(DTYPE_CODES))
        return i

    def rollback_group(self, group: int) -> None:
        """Undo the group's last update (p, m, v, the step count and the working copy)."""
        i = self._index(group)
        record = self._ledger.pending(i, "roll back")
        self.storage.rollback(i, record)
        self._ledger.rolled_back(i, record)

    def correct_group(self, group: int, clip: float) -> None:
        """Replace the group's last update by the same step with clip factor `clip`, in one
        pass over p, m, v and the gradient (the pre-step state comes from the snapshot in
        exact mode, bit-exact; otherwise from the arithmetic inverse, within the bound of
        docs/cpu_optimizer.md, "Clipping corrections"). The working copy is rewritten."""
        i = self._index(group)
        record = self._ledger.pending(i, "correct")
        check_clip(clip)
        corrected = replace(record, clip=float(clip))
        self.storage.correct(i, record, corrected)
        self._ledger.corrected(i, corrected)

    def commit_group(self, group: int) -> None:
        """Forget the group's last update (its gradient may be reused from now on); on
        disk, its staged state becomes the committed one."""
        i = self._index(group)
        self.storage.commit(i)
        self._ledger.commit(i)

    def has_update(self, group: int) -> bool:
        return self._ledger.has_update(self._index(group))

    # --- subgroups (Deep Optimizer States) ----------------------------------------------

    def set_subgroups(self, group: int, subgroups: Sequence[Subgroup] | None,
                      device: DeviceUpdater | None = None) -> None:
        """Step `group` in these subgroups from now on (None: in one piece): those marked
        on_device through `device`, the others with the kernel, concurrently. Rollbacks
        and corrections run on the kernel over the host state, per subgroup (the device
        flushes p, m, v back before its step counts as done). The group must have no
        pending update."""
        self._share.set(self._index(group), subgroups, device)

    def subgroups(self, group: int) -> tuple[Subgroup, ...] | None:
        return self._share.of(self._index(group))

    def device_tail(self) -> tuple[float, float]:
        """(when the CPU's part of the latest steps ended, when their device subgroups
        did), in time.perf_counter() seconds: between the two only the device worked."""
        return self._share.cpu_done_s, self._share.device_done_s

    def _index(self, group: int) -> int:
        if not 0 <= group < len(self._numel):
            raise IndexError(f"group={group} out of range; this optimizer has {len(self._numel)} groups")
        return group
