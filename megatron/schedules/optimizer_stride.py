"""How many optimizer subgroups the CPU should update for each one the device updates.

The performance model of Deep Optimizer States (its Eq. 1): with k subgroups of S
parameters updated on the CPU for every one updated on the device, the CPU's work for
those k (update at Uc params/s, then the fp32 -> 16-bit downscale at Dc params/s) should
take as long as the device's: the device subgroup's fp32 p, m, v flushed out (D2H) while
the next one's come in (H2D) at B params/s each way, the k downscaled 16-bit copies also
going H2D, and the device update at Ug params/s:

    k (S/Uc + S/Dc) = max(3S/B, 3S/B + kS/(2B)) + S/Ug
    k = (3/B + 1/Ug) / (1/Uc + 1/Dc - 1/(2B))

S cancels: k does not depend on the subgroup size. A non-positive denominator means the
CPU path is no slower than moving a subgroup's 16-bit copy: every subgroup stays on the
CPU (stride 0). Pure arithmetic, no torch: the simulator and the tools use it too.

A placement ("split") is one signed integer, as the flag, the config and the plan carry it:
K > 0, every K-th subgroup on the device (Algorithm 1's stride, 1 in K there); -N (N >= 2),
every N-th subgroup on the CPU and the other N - 1 on the device (GPU-heavy: what the
balance asks for when k_real < 1, which no stride can give); 0, all on the CPU. The flag
spells -N as `device:N` (megatron/config/placement.py reads and writes it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megatron.config.placement import split_flag


@dataclass(frozen=True)
class UpdateRates:
    """Throughputs in parameters per second (the paper's B, Ug, Uc, Dc), and what Eq. 1
    takes for granted, as measured: how far the device's side and the CPU's run at once
    (`overlap`), and what each device subgroup costs beyond its parameters
    (`subgroup_overhead_s`). The defaults are Eq. 1's assumptions (full overlap, no fixed
    cost)."""

    h2d_params_per_s: float  # B: fp32 parameters per second over each copy direction
    gpu_update_params_per_s: float  # Ug
    cpu_update_params_per_s: float  # Uc
    downscale_params_per_s: float  # Dc: fp32 -> 16-bit conversion on the CPU
    # the share of the shorter side's time hidden under the longer's when both run at once:
    # 1 a GPU beside the host's cores, 0 a "device" that shares the kernel's cores
    overlap: float = 1.0
    subgroup_overhead_s: float = 0.0  # seconds per device subgroup beyond its parameters
    # the device side's measured throughput through the subgroup mechanism (load, update,
    # flush, subgroups back to back); None: Eq. 1's, 1 / (3/B + 1/Ug)
    device_subgroup_params_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("h2d_params_per_s", "gpu_update_params_per_s", "cpu_update_params_per_s",
                     "downscale_params_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        if not (isinstance(self.overlap, (int, float)) and 0.0 <= self.overlap <= 1.0):
            raise ValueError(f"overlap={self.overlap!r} must be within [0, 1]")
        if not (isinstance(self.subgroup_overhead_s, (int, float))
                and math.isfinite(self.subgroup_overhead_s) and self.subgroup_overhead_s >= 0):
            raise ValueError(f"subgroup_overhead_s={self.subgroup_overhead_s!r} must be a "
                             "finite number >= 0")
        chain = self.device_subgroup_params_per_s
        if chain is not None and not (isinstance(chain, (int, float)) and math.isfinite(chain)
                                      and chain > 0):
            raise ValueError(f"device_subgroup_params_per_s={chain!r} must be a finite number "
                             "> 0 (or None)")

    @property
    def device_s_per_param(self) -> float:
        """The device side's seconds per parameter of its subgroups: measured, or Eq. 1's."""
        if self.device_subgroup_params_per_s is not None:
            return 1.0 / self.device_subgroup_params_per_s
        return 3.0 / self.h2d_params_per_s + 1.0 / self.gpu_update_params_per_s


@dataclass(frozen=True)
class StrideModel:
    """Eq. 1 solved: `k_real` the exact ratio, `k` the stride to use (0: all on the CPU)."""

    k: int
    k_real: float
    numerator: float  # 3/B + 1/Ug: device-side seconds per parameter of one subgroup
    denominator: float  # 1/Uc + 1/Dc - 1/(2B): CPU-side seconds per parameter, net
    transfer_s_per_param: float  # 3/B
    gpu_update_s_per_param: float  # 1/Ug
    cpu_update_s_per_param: float  # 1/Uc
    downscale_s_per_param: float  # 1/Dc
    half_copy_s_per_param: float  # 1/(2B)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def device_share(self) -> float:
        """The share of subgroups Eq. 1's balance puts on the device: k_real on the CPU for
        each one there, 1 / (1 + k_real). Above 1/2 when k_real < 1, which no stride (one
        subgroup in k on the device) can express."""
        return 1.0 / (1.0 + self.k_real)


def gpu_update_stride(rates: UpdateRates) -> StrideModel:
    """k from Eq. 1, rounded to the nearest integer and at least 2 (every k-th subgroup
    on the device; k = 1 would leave the CPU idle); 0 when the CPU path is not slower."""
    b, ug = rates.h2d_params_per_s, rates.gpu_update_params_per_s
    uc, dc = rates.cpu_update_params_per_s, rates.downscale_params_per_s
    numerator = 3.0 / b + 1.0 / ug
    denominator = 1.0 / uc + 1.0 / dc - 1.0 / (2.0 * b)
    if denominator <= 0.0:
        k_real, k = math.inf, 0
    else:
        k_real = numerator / denominator
        k = max(2, int(math.floor(k_real + 0.5)))
    return StrideModel(k, k_real, numerator, denominator, 3.0 / b, 1.0 / ug, 1.0 / uc, 1.0 / dc,
                       1.0 / (2.0 * b))


def is_device_subgroup(index: int, split: int) -> bool:
    """Algorithm 1's test (0-based subgroups, 1-based stride): (i + 1) % k == 0; for a
    GPU-heavy split -N its complement, (i + 1) % N != 0."""
    if split < 0:
        return (index + 1) % -split != 0
    return split > 0 and (index + 1) % split == 0


def device_share(split: int) -> float:
    """The share of subgroups `split` puts on the device: 1/K, (N - 1)/N, or 0."""
    if split < 0:
        return 1.0 - 1.0 / -split
    return 1.0 / split if split else 0.0


# The layout auto_split predicts at (100 subgroups: the tail flush weighs 1%); the split
# it picks is used by the runtime, the planner and the tool alike.
REFERENCE_NUMEL = 10**9
REFERENCE_SUBGROUP = 10**7


@dataclass(frozen=True)
class SplitChoice:
    """The split `--optimizer-gpu-stride auto` takes, and the timing model's prediction
    (interleaved_update_time at the reference layout) of every candidate weighed."""

    split: int
    model: StrideModel
    predicted_s: dict[int, float]
    numel: int = REFERENCE_NUMEL  # the layout they are predicted at: parameters
    subgroup: int = REFERENCE_SUBGROUP  # in subgroups of this many

    def as_dict(self) -> dict:
        return {"split": self.split, "flag": split_flag(self.split),
                "device_share": device_share(self.split),
                "predicted_s": {split_flag(s): t for s, t in self.predicted_s.items()}}


def auto_split(rates: UpdateRates, numel: int = REFERENCE_NUMEL,
               subgroup: int = REFERENCE_SUBGROUP) -> SplitChoice:
    """All on the CPU (0), Eq. 1's stride k and, where k_real < 1, the GPU-heavy splits next
    to the balance (N - 1 on the device per one on the CPU = 1/k_real, N = 1 + 1/k_real,
    floor and ceil), each predicted for `numel` parameters in subgroups of `subgroup` (the
    layout the device memory allows); the fastest taken, the earlier on a tie: a device
    split only where it is predicted faster than all on the CPU, so auto never loses to 0
    by its own prediction."""
    model = gpu_update_stride(rates)
    candidates = [0]
    if model.k:
        candidates.append(model.k)
    if model.k and model.k_real < 1:
        n = 1.0 + 1.0 / model.k_real
        candidates += sorted({-max(2, math.floor(n)), -max(2, math.ceil(n))}, reverse=True)
    predicted = {s: interleaved_update_time(numel, subgroup, s, rates) for s in candidates}
    return SplitChoice(min(candidates, key=predicted.__getitem__), model, predicted, numel,
                       subgroup)


def interleaved_update_time(numel: int, subgroup: int, split: int, rates: UpdateRates) -> float:
    """Seconds to update `numel` parameters in subgroups of `subgroup` placed by `split`
    (see the module docstring; 0: all on the CPU): the slower side's total time, plus the
    part of the other's that does not overlap it (none in Eq. 1: `rates.overlap` = 1), plus
    the last device subgroup's flush that nothing hides. The device side's subgroups cost
    `rates.device_s_per_param` each parameter (Eq. 1's 3/B + 1/Ug unless measured) and
    `rates.subgroup_overhead_s` each."""
    count = max(1, math.ceil(numel / subgroup))
    sizes = [min(numel, (i + 1) * subgroup) - i * subgroup
             for i in range(count) if is_device_subgroup(i, split)]
    on_device = sum(sizes)
    cpu_params = numel - on_device
    cpu_s = cpu_params * (1.0 / rates.cpu_update_params_per_s + 1.0 / rates.downscale_params_per_s)
    b = rates.h2d_params_per_s
    device_s = on_device * rates.device_s_per_param + len(sizes) * rates.subgroup_overhead_s
    device_s += cpu_params / (2.0 * b)  # the CPU-updated 16-bit copies share the H2D link
    tail = subgroup * 3.0 / b + rates.subgroup_overhead_s if on_device else 0.0
    exposed = (1.0 - rates.overlap) * min(cpu_s, device_s)
    return max(cpu_s, device_s) + exposed + tail
