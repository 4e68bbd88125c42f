"""Where the host optimizer's updates run and where its states live: one frozen value.

Five flags spell it (--optimizer-gpu-stride, --optimizer-gpu-resident-fraction,
--optimizer-subgroup-size, --optimizer-state-location, --optimizer-nvme-path). The run
configuration reads them into a `Placement` once (`CpuOptimizerConfig.placement`, checked
here when the configuration is built); above it, code takes the value, not the flags:
megatron/schedules/placement_cost.py prices it for the planner and the memory model, and
megatron/pipeline/assembly.py executes it.

The device's share of the updates (`DeviceShare`) is one of:
- `OnHost`: every update on the CPU (--optimizer-gpu-stride 0, the default);
- `Interleaved(split)`: Deep Optimizer States. The stages whose CPU update would be
  exposed update in subgroups, the split placing them: K > 0, every K-th subgroup on the
  device; -N (device:N), all but every N-th (megatron/schedules/optimizer_stride.py);
- `AutoSplit`: the same with the split Eq. 1 picks from the calibrated rates (auto);
- `Resident(fraction)`: the static split (Twin-Flow): that fraction of every owned stage's
  state lives on the device and is always updated there.

Adding a placement takes three files: a `DeviceShare` subclass here (its checks and the
flags it stands for), its device memory and update time in placement_cost.py, and its
execution in megatron/pipeline/assembly.py (a case in `Pipeline._device_updates`).
docs/architecture.md shows one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.config.errors import ConfigError

if TYPE_CHECKING:
    from megatron.config.run import CpuOptimizerConfig

STRIDE_FLAG = "--optimizer-gpu-stride"
RESIDENT_FLAG = "--optimizer-gpu-resident-fraction"


def split_flag(split: int) -> str:
    """`split` as --optimizer-gpu-stride spells it: K, device:N or 0."""
    return f"device:{-split}" if split < 0 else str(split)


def parse_gpu_stride(text: str) -> int | None:
    """--optimizer-gpu-stride's value: 'auto' (None), K >= 0, or 'device:N' with N >= 2
    (-N); ValueError with the expected forms otherwise."""
    if text == "auto":
        return None
    head, _, count = text.partition(":")
    try:
        value = int(count if head == "device" else text)
    except ValueError:
        value = -1
    if head == "device" and value >= 2:
        return -value
    if head != "device" and value >= 0:
        return value
    raise ValueError(f"{text!r}: expected auto, K >= 0 (every K-th subgroup on the GPU) or "
                     f"device:N with N >= 2 (N-1 of every N subgroups on the GPU)")


@dataclass(frozen=True)
class DeviceShare:
    """The device's share of the optimizer updates; the base class is none of them."""

    @property
    def uses_device(self) -> bool:
        return True

    @property
    def marks_exposed_stages(self) -> bool:
        """The lowering marks the updates of the stages that would be exposed
        OPTIMIZER_START_SUBGROUPS (megatron/schedules/optimizer_placement.py)."""
        return False

    @property
    def split(self) -> int | None:
        """The subgroup split as reports and metrics carry it: K, -N, 0 (none), None
        (chosen at start-up)."""
        return 0

    def flags(self) -> dict[str, object]:
        """The run configuration's fields that spell it."""
        return {"optimizer_gpu_stride": 0, "optimizer_gpu_resident_fraction": 0.0}

    def planned_flags(self) -> str:
        """What a plan prints for it among the flags it varies ('' when it keeps the run's)."""
        return ""

    def check(self, placement: Placement) -> None:
        """Raise ConfigError when it cannot run with the rest of `placement`."""


@dataclass(frozen=True)
class OnHost(DeviceShare):
    """Every update on the CPU."""

    @property
    def uses_device(self) -> bool:
        return False


@dataclass(frozen=True)
class Interleaved(DeviceShare):
    """Subgroups of the exposed stages' updates on the device, placed by `split`."""

    split_value: int  # K > 0 or -N with N >= 2

    def __post_init__(self) -> None:
        if self.split_value == 0 or self.split_value == -1:
            raise ConfigError(STRIDE_FLAG, self.split_value,
                              "K > 0 or device:N with N >= 2 for device subgroups")

    @property
    def marks_exposed_stages(self) -> bool:
        return True

    @property
    def split(self) -> int:
        return self.split_value

    def flags(self) -> dict[str, object]:
        return {**super().flags(), "optimizer_gpu_stride": self.split_value}

    def planned_flags(self) -> str:
        return f"{STRIDE_FLAG} {split_flag(self.split_value)}"


@dataclass(frozen=True)
class AutoSplit(DeviceShare):
    """Interleaved, with the split Eq. 1 takes from the calibrated update rates."""

    @property
    def marks_exposed_stages(self) -> bool:
        return True

    @property
    def split(self) -> None:
        return None

    def flags(self) -> dict[str, object]:
        return {**super().flags(), "optimizer_gpu_stride": None}

    def planned_flags(self) -> str:
        return f"{STRIDE_FLAG} auto"


@dataclass(frozen=True)
class Resident(DeviceShare):
    """The static split: `fraction` of every owned stage's state on the device for good."""

    fraction: float  # in (0, 1]

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(RESIDENT_FLAG, self.fraction, "expected a value in [0, 1]")

    def flags(self) -> dict[str, object]:
        return {**super().flags(), "optimizer_gpu_resident_fraction": self.fraction}

    def check(self, placement: Placement) -> None:
        if placement.states.on_nvme:
            raise ConfigError("--optimizer-state-location", "nvme",
                              "host with --optimizer-gpu-resident-fraction (the static split "
                              "keeps part of every state on the device for good)")


ON_HOST = OnHost()


@dataclass(frozen=True)
class StateStorage:
    """Where master, m and v live: host memory, or files on an NVMe drive under
    `nvme_path` with a window of them in host memory (a plan needs no path)."""

    on_nvme: bool = False
    nvme_path: str | None = None

    def __post_init__(self) -> None:
        if self.nvme_path is not None and not self.on_nvme:
            raise ConfigError("--optimizer-nvme-path", self.nvme_path,
                              "only with --optimizer-state-location nvme")

    @property
    def location(self) -> str:
        """--optimizer-state-location's word: host or nvme."""
        return "nvme" if self.on_nvme else "host"


IN_HOST_MEMORY = StateStorage()


@dataclass(frozen=True)
class Placement:
    """Where the optimizer's subgroups update (`updates`) and where its states live."""

    updates: DeviceShare = field(default=ON_HOST)
    states: StateStorage = field(default=IN_HOST_MEMORY)
    subgroup_size: int | None = None  # parameters per subgroup; None: from the largest stage

    def __post_init__(self) -> None:
        if self.subgroup_size is not None and self.subgroup_size <= 0:
            raise ConfigError("--optimizer-subgroup-size", self.subgroup_size,
                              "expected a positive integer")
        self.updates.check(self)

    @classmethod
    def of(cls, c: CpuOptimizerConfig) -> Placement:
        """The run configuration's flags read (ConfigError naming the flag if they do not
        make one)."""
        fraction, stride = c.optimizer_gpu_resident_fraction, c.optimizer_gpu_stride
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(RESIDENT_FLAG, fraction, "expected a value in [0, 1]")
        if fraction > 0 and stride != 0:
            raise ConfigError(RESIDENT_FLAG, fraction,
                              "the static split excludes --optimizer-gpu-stride (give one of "
                              "them)")
        if fraction > 0:
            updates: DeviceShare = Resident(fraction)
        elif stride is None:
            updates = AutoSplit()
        else:
            updates = Interleaved(stride) if stride else ON_HOST
        if c.optimizer_state_location not in ("host", "nvme"):
            raise ConfigError("--optimizer-state-location", c.optimizer_state_location,
                              "host or nvme")
        states = StateStorage(c.optimizer_state_location == "nvme", c.optimizer_nvme_path)
        return cls(updates, states, c.optimizer_subgroup_size)

    @property
    def uses_device(self) -> bool:
        return self.updates.uses_device

    def flags(self) -> dict[str, object]:
        """The run configuration's fields that spell it (the inverse of `of`)."""
        return {**self.updates.flags(), "optimizer_subgroup_size": self.subgroup_size,
                "optimizer_state_location": self.states.location,
                "optimizer_nvme_path": self.states.nvme_path}


DEFAULT_PLACEMENT = Placement()  # every update on the CPU, the states in host memory
