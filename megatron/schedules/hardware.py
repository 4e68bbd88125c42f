"""Hardware profiles: what one node offers (memory capacities and throughputs), as JSON data.

The built-in profiles live in `hardware_profiles/*.json` beside this module (the SysX
testbed and an H100 SXM node); `tools/profile_hardware.py` writes the same format for the
machine it runs on. The cost model prices compute and transfers from a profile, the memory
model compares its needs with the capacities.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass

from megatron.config.model import ModelConfig, materializes_attention_scores

from .optimizer_stride import UpdateRates

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware_profiles")


class ProfileError(ValueError):
    """A profile field whose value means nothing: one line naming the field, the value
    and what was expected."""


@dataclass(frozen=True)
class FieldRule:
    """What one profile field may hold: its type, its range (`low`, `above`: the bound
    excluded, `high`; for a string `low` is its least length), null when `nullable`, one
    of `choices`; `expected` says it in the message's words."""

    kind: type
    expected: str
    low: float | None = None
    above: bool = False
    high: float | None = None
    nullable: bool = False
    choices: tuple[str, ...] = ()

    def checked(self, name: str, value: object) -> object:
        """`value` as the profile keeps it (a whole float in an int field becomes an int);
        ProfileError when the rule refuses it."""
        if value is None and self.nullable:
            return value
        if self.kind in (int, float) and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            number = value
            if self.kind is int and isinstance(value, float):
                if not (math.isfinite(value) and value.is_integer()):
                    raise self.error(name, value)
                number = int(value)
            if not math.isfinite(number) or (self.low is not None and (
                    number < self.low or (self.above and number == self.low))) or (
                    self.high is not None and number > self.high):
                raise self.error(name, value)
            return number
        if self.kind is str and isinstance(value, str) and (
                not self.choices or value in self.choices) and len(value) >= (self.low or 0):
            return value
        if self.kind is dict and isinstance(value, dict):
            return value
        raise self.error(name, value)

    def error(self, name: str, value: object) -> ProfileError:
        try:
            shown = json.dumps(value)  # as the file spells it (null, true, NaN)
        except (TypeError, ValueError):
            shown = repr(value)
        return ProfileError(f"field {name!r} is {shown}; expected {self.expected}")


def _positive(unit: str) -> FieldRule:
    return FieldRule(float, f"{unit} > 0 (a finite number)", low=0.0, above=True)


def _zero_unknown(unit: str, kind: type = float, zero: str = "unknown") -> FieldRule:
    return FieldRule(kind, f"{unit} >= 0 (0: {zero})", low=0.0)


def _fraction(lowest_meaningful: str) -> FieldRule:
    return FieldRule(float, f"a fraction {lowest_meaningful} to 1", low=0.0,
                     above=lowest_meaningful == "above 0", high=1.0)


_TEXT = FieldRule(str, "a string")
# One rule per field of HardwareProfile, by what the figure means: a rate or capacity the
# models divide by is > 0; one where 0 (or null) stands for unknown, none or "the default"
# is >= 0 (or null); fractions are in range; every number is finite.
FIELD_RULES: dict[str, FieldRule] = {
    "name": FieldRule(str, "a non-empty name", low=1),
    "description": _TEXT,
    "gpu_peak_flops": _positive("FLOP/s"),
    "gpu_max_efficiency": _fraction("above 0"),
    "efficiency_half_tokens": _zero_unknown("a whole number of tokens", int,
                                            "the peak at any size"),
    "pcie_bytes_per_s": _positive("bytes per second"),
    "p2p_bytes_per_s": _positive("bytes per second"),
    "cpu_optimizer_params_per_s": _positive("parameters per second"),
    "gpus_per_node": FieldRule(int, "a whole number of GPUs >= 1", low=1),
    "gpu_memory_bytes": _zero_unknown("bytes", int),
    "gpu_reserved_bytes": _zero_unknown("bytes", int, "none"),
    "d2h_bytes_per_s": _zero_unknown("bytes per second", zero="as pcie_bytes_per_s"),
    "h2d_shm_bytes_per_s": _zero_unknown("bytes per second"),
    "host_memory_bytes_per_s": _zero_unknown("bytes per second"),
    "cpu_cores": _zero_unknown("a whole number of cores", int),
    "host_memory_bytes": _zero_unknown("bytes", int),
    "shm_bytes": _zero_unknown("bytes", int),
    "memlock_bytes": FieldRule(int, "bytes >= 0, or null (unlimited)", low=0, nullable=True),
    "process_baseline_bytes": _zero_unknown("bytes", int, "not counted"),
    "inter_node_bytes_per_s": _zero_unknown("bytes per second"),
    "gpu_update_params_per_s": _zero_unknown("parameters per second"),
    "downscale_params_per_s": _zero_unknown("parameters per second"),
    "nvme_read_bytes_per_s": _zero_unknown("bytes per second", zero="no drive"),
    "nvme_write_bytes_per_s": _zero_unknown("bytes per second", zero="no drive"),
    "nvme_capacity_bytes": _zero_unknown("bytes", int, "no drive"),
    "pass_overhead_s": _zero_unknown("seconds", zero="none"),
    "backward_over_forward": _zero_unknown("a ratio", zero="a free backward"),
    "head_rate_over_layer": _positive("a ratio"),
    "head_backward_over_forward": FieldRule(float, "a ratio >= 0, or null (as "
                                            "backward_over_forward)", low=0.0, nullable=True),
    "p2p_latency_s": _zero_unknown("seconds", zero="bandwidth alone"),
    "instruction_overhead_s": _zero_unknown("seconds", zero="free"),
    "executor_compute_over_pass": _positive("a ratio"),
    "device_kind": FieldRule(str, '"cuda" or "cpu"', choices=("cuda", "cpu")),
    "source": _TEXT,
    "datasheet_peak_flops": FieldRule(float, "FLOP/s > 0, or null (unknown)", low=0.0,
                                      above=True, nullable=True),
    "compute_shape": FieldRule(dict, "an object (the measured layer), or null",
                               nullable=True),
    "compute_spread": _zero_unknown("a relative spread", zero="none measured"),
    "device_subgroup_params_per_s": FieldRule(float, "parameters per second > 0, or null "
                                              "(Eq. 1's rate)", low=0.0, above=True,
                                              nullable=True),
    "subgroup_overhead_s": _zero_unknown("seconds", zero="none"),
    "update_overlap": _fraction("from 0"),
    "single_update_share": _fraction("above 0"),
}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpu_peak_flops: float  # the compute model's peak: dense 16-bit throughput, or a fitted rate
    gpu_max_efficiency: float  # fraction of peak reached by large matmuls
    efficiency_half_tokens: int  # tokens per micro-batch at which half of that is reached
    pcie_bytes_per_s: float  # effective host -> device bandwidth per GPU, pinned memory
    p2p_bytes_per_s: float  # GPU <-> GPU bandwidth
    cpu_optimizer_params_per_s: float  # mixed-precision Adam steps per second, whole node
    gpus_per_node: int
    gpu_memory_bytes: int = 0  # per GPU
    gpu_reserved_bytes: int = 0  # per GPU: CUDA context and allocator slack, not ours to use
    d2h_bytes_per_s: float = 0.0  # device -> host, pinned (0: as pcie_bytes_per_s)
    h2d_shm_bytes_per_s: float = 0.0  # host -> device from the shared-memory store
    host_memory_bytes_per_s: float = 0.0  # one-core-group copy/convert rate of host memory
    cpu_cores: int = 0
    host_memory_bytes: int = 0  # per node
    shm_bytes: int = 0  # /dev/shm capacity per node
    memlock_bytes: int | None = None  # ulimit -l per process; None: unlimited
    process_baseline_bytes: int = 0  # host memory of one training process before the model
    inter_node_bytes_per_s: float = 0.0  # one node's network link, each way (0: unknown)
    # The optimizer's device path (Deep Optimizer States' Ug and Dc, parameters per second):
    # AdamW on the GPU in fp32, and the CPU's fp32 -> 16-bit downscale (0: unknown; the
    # downscale then follows from host_memory_bytes_per_s at 6 bytes per parameter)
    gpu_update_params_per_s: float = 0.0
    downscale_params_per_s: float = 0.0
    # The node's drives for optimizer states on NVMe (--optimizer-state-location nvme):
    # sequential O_DIRECT bandwidth and capacity, all drives together (0: none known)
    nvme_read_bytes_per_s: float = 0.0
    nvme_write_bytes_per_s: float = 0.0
    nvme_capacity_bytes: int = 0
    # Host time of one forward or backward pass of a stage that the GPU does not hide
    # (Python and Megatron's per-pass work, kernel launches, stream and event syncs), added
    # to every FORWARD/BACKWARD instruction's compute time (0: none, the ideal launch)
    pass_overhead_s: float = 0.0
    # A backward pass's time over its forward's, the recompute not counted (2: twice the
    # flops, the usual figure; the CPU device layer's is measured)
    backward_over_forward: float = 2.0
    # The head (final norm, output layer to the vocabulary, cross-entropy loss): its
    # forward's rate in the flops the cost model counts for it (2 * hidden * vocabulary a
    # token) over a decoder layer's forward rate at the same tokens per micro-batch, and
    # its BACKWARD's time (the recompute taken out) over its FORWARD's; measured as a
    # one-layer stage's, at the run's shape (1 and None: priced as a decoder layer)
    head_rate_over_layer: float = 1.0
    head_backward_over_forward: float | None = None
    # One small point-to-point message between two GPUs' processes (half a ping-pong round
    # trip: the communication library's launch, the rendezvous and the wire's latency), added
    # to every activation, gradient and checkpoint transfer (0: bandwidth alone)
    p2p_latency_s: float = 0.0
    # Host time of every instruction of a program beyond its compute and its transfer
    # (the executor's dispatch: slots filled and released, modules bound, events recorded,
    # transfers posted), added to the issuing rank's clock before each instruction, every
    # kind alike; measured on a one-process pipeline, where nothing waits on a peer (0: free)
    instruction_overhead_s: float = 0.0
    # The compute of the executor's FORWARD and BACKWARD instructions over the same stages'
    # passes timed alone (a stage's module and nothing else: tools/profile_hardware.py's
    # pass_times), measured on that one-process pipeline, all GPUs' processes at once; it
    # scales every priced pass. What an instruction's compute carries beyond its stage's
    # pass: the parameters bound to their slot and the gradients to their buffer, the wait
    # for a late copy, and, on the CPU device layer, where a rank's compute runs on its
    # main thread, the cores it shares with the rank's own copy, optimizer and
    # communication threads (on a GPU these run beside it; there it is near 1). 1: the
    # passes alone (not measured)
    executor_compute_over_pass: float = 1.0
    device_kind: str = "cuda"  # "cpu": the CPU device layer plays the GPUs (tests, CI)
    source: str = ""  # where the figures come from
    # The device's datasheet peak (dense, 16-bit), what MFU is reported against; None:
    # unknown (a measured profile of a device without a datasheet figure), and MFU is then
    # reported against gpu_peak_flops, the profile's own measured rate, and says so
    datasheet_peak_flops: float | None = None
    # The decoder layer compute was measured at (tools/profile_hardware.py: layer_shape()
    # of the model it was given, plus the micro-batch sizes, dtype and the vocabulary of
    # the head it measured); None: not measured
    compute_shape: dict | None = None
    # The measured layer rate's spread over the profile's rounds: (max - min) / median
    compute_spread: float = 0.0
    # The optimizer's device subgroups as their mechanism runs (what --optimizer-gpu-stride
    # auto measures at start-up, megatron/pipeline/optimizer_calibration.py): parameters
    # per second with subgroups back to back (None: Eq. 1's 1 / (3/B + 1/Ug)), the fixed
    # cost of each subgroup, and how far the device's side overlaps the C++ kernel (1:
    # fully, Eq. 1's assumption, a GPU beside the host's cores)
    device_subgroup_params_per_s: float | None = None
    subgroup_overhead_s: float = 0.0
    update_overlap: float = 1.0
    # The share of its GPU's part of the node's CPU Adam rate (cpu_optimizer_params_per_s /
    # gpus_per_node) that one stage's update reaches while no other update of that GPU's
    # process runs beside it; two or more side by side reach the whole. 1: an update alone
    # takes all of it (this runtime: every update of a process shares one pool of kernel
    # threads); below 1: each update on threads of its own that one alone cannot fill (the
    # SysX implementation's thread per backward stage). Range (0, 1].
    single_update_share: float = 1.0

    def __post_init__(self) -> None:
        """Every field checked by its rule in FIELD_RULES (a field without one is an error
        here, at import: no figure reaches the planner unchecked)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kept = FIELD_RULES[f.name].checked(f.name, value)
            if kept is not value:
                object.__setattr__(self, f.name, kept)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @property
    def mfu_against_datasheet(self) -> bool:
        return self.datasheet_peak_flops is not None

    @property
    def mfu_peak_flops(self) -> float:
        """A GPU's peak that model FLOPs utilization divides by: the datasheet's where the
        profile has it, else the profile's own peak rate."""
        return self.datasheet_peak_flops or self.gpu_peak_flops


# A field added without its rule (or a rule left without its field) stops the import here,
# with its name, before any profile is read.
_UNRULED = sorted({f.name for f in dataclasses.fields(HardwareProfile)} ^ set(FIELD_RULES))
if _UNRULED:
    raise TypeError(f"HardwareProfile and FIELD_RULES disagree on {_UNRULED}: every field "
                    "needs one rule")


def layer_shape(model: ModelConfig) -> dict:
    """What a decoder layer's compute rate depends on, as tools/profile_hardware.py records
    it in `compute_shape`."""
    return {"hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups, "head_dim": model.head_dim,
            "seq_length": model.seq_length,
            "attention_scores": materializes_attention_scores(model.attention_backend)}


def fit_efficiency_curve(points: dict[int, float]) -> tuple[float, float]:
    """(gpu_peak_flops, efficiency_half_tokens) of a measured profile (gpu_max_efficiency
    1): the cost model's curve f(t) = peak * t / (t + half) through the rates `points`
    (tokens per micro-batch -> flops/s), by least squares on 1/f = 1/peak + (half/peak) / t. A
    rate that does not grow with the tokens gives half = 0 (their harmonic mean); one that
    grows as if without a limit, the largest rate at half = 0."""
    xs = [1.0 / t for t in points]
    ys = [1.0 / f for f in points.values()]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x if var_x else 0.0
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        return 1.0 / mean_y, 0.0
    if intercept <= 0:
        return max(points.values()), 0.0
    return 1.0 / intercept, slope / intercept


def shape_differences(hardware: HardwareProfile, model: ModelConfig) -> list[str]:
    """The layer-shape fields where `model` differs from the layer the profile measured
    ("name measured -> model's"), and the vocabulary where it measured the head; empty
    when they agree or the profile measured none."""
    if hardware.compute_shape is None:
        return []
    # the vocabulary where the profile measured the head (its rate changes with it)
    head = ({"vocab_size": model.planned_vocab_size}
            if "vocab_size" in hardware.compute_shape else {})
    return [f"{name} {hardware.compute_shape.get(name)} -> {value}"
            for name, value in {**layer_shape(model), **head}.items()
            if hardware.compute_shape.get(name) != value]


def profile_from_dict(values: dict, origin: str = "profile") -> HardwareProfile:
    """A profile from parsed JSON; ProfileError naming `origin` and the field on a missing,
    unknown or meaningless one (FIELD_RULES)."""
    if not isinstance(values, dict):
        raise ProfileError(f"{origin}: expected a JSON object of fields, found "
                           f"{type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ProfileError(f"{origin}: unknown field {unknown[0]!r}; expected "
                           f"{', '.join(fields)}")
    missing = [name for name, f in fields.items()
               if f.default is dataclasses.MISSING and name not in values]
    if missing:
        raise ProfileError(f"{origin}: missing field {missing[0]!r}")
    try:
        return HardwareProfile(**values)
    except ProfileError as exc:
        raise ProfileError(f"{origin}: {exc}") from None


def _builtin_profiles() -> dict[str, HardwareProfile]:
    profiles = {}
    for name in sorted(os.listdir(PROFILE_DIR)):
        if name.endswith(".json"):
            path = os.path.join(PROFILE_DIR, name)
            with open(path, encoding="utf-8") as f:
                profile = profile_from_dict(json.load(f), path)
            profiles[profile.name] = profile
    return profiles


HARDWARE_PROFILES: dict[str, HardwareProfile] = _builtin_profiles()


def _decode_problem(exc: ValueError) -> str:
    """Where and why a file failed to decode as UTF-8 JSON, in a few words."""
    if isinstance(exc, UnicodeDecodeError):
        return f"byte {exc.start} is not UTF-8"
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno} column {exc.colno}: {exc.msg}"
    return str(exc)


def get_hardware(name: str) -> HardwareProfile:
    """A built-in profile by name, or a JSON profile file by path; KeyError with one line
    (its first argument) naming what is wrong."""
    if name in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[name]
    if name.endswith(".json") or os.sep in name:
        try:
            with open(name, encoding="utf-8") as f:
                values = json.load(f)
        except OSError as exc:
            raise KeyError(f"hardware profile {name!r} cannot be read ({exc.strerror})") from None
        except ValueError as exc:  # not UTF-8 (a binary file), or not JSON
            raise KeyError(f"hardware profile {name!r} is not a JSON profile from "
                           f"tools/profile_hardware.py ({_decode_problem(exc)})") from None
        try:
            return profile_from_dict(values, f"hardware profile {name!r}")
        except ProfileError as exc:
            raise KeyError(str(exc)) from None
    raise KeyError(f"unknown hardware {name!r}; expected one of {', '.join(HARDWARE_PROFILES)} "
                   "or a profile file (tools/profile_hardware.py)")


def update_rates(hardware: HardwareProfile) -> UpdateRates | None:
    """Eq. 1's four rates for one GPU of `hardware` (None when the profile lacks the device
    update rate): B from the pinned copy rate in fp32, Uc the node's CPU rate shared by
    its GPUs; with the subgroups' mechanism as the profile measured it (Eq. 1's assumptions
    where it did not), so that --plan's `auto` takes the split the runtime's would."""
    downscale = hardware.downscale_params_per_s or hardware.host_memory_bytes_per_s / 6
    if hardware.gpu_update_params_per_s <= 0 or downscale <= 0:
        return None
    return UpdateRates(hardware.pcie_bytes_per_s / 4, hardware.gpu_update_params_per_s,
                       hardware.cpu_optimizer_params_per_s / hardware.gpus_per_node, downscale,
                       overlap=hardware.update_overlap,
                       subgroup_overhead_s=hardware.subgroup_overhead_s,
                       device_subgroup_params_per_s=hardware.device_subgroup_params_per_s)
