"""Hardware profiles: what one node offers (memory capacities and throughputs), as JSON data.

The built-in profiles live in `hardware_profiles/*.json` beside this module (the SysX
testbed and an H100 SXM node); `tools/profile_hardware.py` writes the same format for the
machine it runs on. The cost model prices compute and transfers from a profile, the memory
model compares its needs with the capacities.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass

from megatron.config.model import ModelConfig, materializes_attention_scores

from .optimizer_stride import UpdateRates

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware_profiles")


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
    # One small point-to-point message between two GPUs' processes (half a ping-pong round
    # trip: the communication library's launch, the rendezvous and the wire's latency), added
    # to every activation, gradient and checkpoint transfer (0: bandwidth alone)
    p2p_latency_s: float = 0.0
    # Host time of every other instruction of a program (a prefetch, an offload, a
    # release, an optimizer hand-off, a checkpoint's post or wait): the dispatch and the
    # stream hand-off, added to the issuing rank's clock (0: free)
    instruction_overhead_s: float = 0.0
    device_kind: str = "cuda"  # "cpu": the CPU device layer plays the GPUs (tests, CI)
    source: str = ""  # where the figures come from
    # The device's datasheet peak (dense, 16-bit), what MFU is reported against; None:
    # unknown (a measured profile of a device without a datasheet figure), and MFU is then
    # reported against gpu_peak_flops, the profile's own measured rate, and says so
    datasheet_peak_flops: float | None = None
    # The decoder layer compute was measured at (tools/profile_hardware.py: layer_shape()
    # of the model it was given, plus the micro-batch sizes and dtype); None: not measured
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
        if not 0.0 <= self.update_overlap <= 1.0:
            raise ValueError(f"update_overlap={self.update_overlap!r}: expected 0 to 1")
        if not 0.0 < self.single_update_share <= 1.0:
            raise ValueError(f"single_update_share={self.single_update_share!r}: expected "
                             "more than 0, at most 1")
        if not self.subgroup_overhead_s >= 0.0:
            raise ValueError(f"subgroup_overhead_s={self.subgroup_overhead_s!r}: expected "
                             "seconds >= 0")
        rate = self.device_subgroup_params_per_s
        if rate is not None and not rate > 0.0:
            raise ValueError(f"device_subgroup_params_per_s={rate!r}: expected parameters "
                             "per second > 0, or null")

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
    ("name measured -> model's"); empty when they agree or the profile measured none."""
    if hardware.compute_shape is None:
        return []
    return [f"{name} {hardware.compute_shape.get(name)} -> {value}"
            for name, value in layer_shape(model).items()
            if hardware.compute_shape.get(name) != value]


def profile_from_dict(values: dict, origin: str = "profile") -> HardwareProfile:
    """A profile from parsed JSON; ValueError naming the field on a missing or unknown key."""
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{origin}: unknown field {unknown[0]!r}; expected {', '.join(fields)}")
    missing = [name for name, f in fields.items()
               if f.default is dataclasses.MISSING and name not in values]
    if missing:
        raise ValueError(f"{origin}: missing field {missing[0]!r}")
    return HardwareProfile(**values)


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
    """A built-in profile by name, or a JSON profile file by path."""
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
            return profile_from_dict(values, name)
        except (TypeError, ValueError) as exc:
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
