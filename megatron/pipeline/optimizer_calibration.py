"""The throughputs of the optimizer-stride model (Eq. 1) and of the subgroup mechanism, measured on this machine
in a short start-up calibration and cached per machine.

B: fp32 parameters per second host -> device through the device layer's H2D stream from a
pinned buffer; Ug: the device's AdamW update rate (in torch ops); Uc: the C++ kernel's update rate (no working copy); Dc: the
fp32 -> 16-bit conversion rate on the CPU. On the CPU device layer "device" means the
same cores, so the figures describe the mechanism, not a GPU.

Beyond Eq. 1's four, the device subgroups' real mechanism (DeviceSubgroupUpdater: load,
update, flush on its streams) is timed: at two subgroup sizes, for its throughput and its
fixed cost per subgroup (a straight line through the two), and once while the C++ kernel
runs on the calling thread, for how far the two sides overlap (a GPU's work runs beside the kernel;
the CPU layer's "device" competes with it for the same cores). Measured alike on both
layers: no branch on the device kind.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.common.files import atomic_write
from megatron.config.device_choice import DeviceChoice
from megatron.offload.device import DeviceLayer, get_device
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.subgroups import AdamHyper
from megatron.pipeline.subgroup_device import DeviceSubgroupUpdater
from megatron.schedules.optimizer_stride import UpdateRates
from megatron.schedules.subgroup_memory import MIN_SUBGROUP

CACHE_VERSION = 2  # 2: the mechanism's throughput, fixed cost and overlap
CALIBRATION_NUMEL = 1 << 19  # parameters per measurement, or the run's subgroup if smaller


def _rate(numel: int, run: Callable[[], None], finish: Callable[[], None], repeats: int,
          trials: int = 3) -> float:
    """Parameters per second of `repeats` runs, the best of `trials` after a warm-up (one
    timing of a 2 MiB copy on a shared machine came out 20x low, and Eq. 1 with it)."""
    run()  # warm-up
    finish()

    def timed() -> Callable[[], None]:
        for _ in range(repeats):
            run()
        return finish
    return numel * repeats / _seconds(timed, trials)


def _device_adam(device: DeviceLayer, numel: int) -> Callable[[], None]:
    """AdamW on device tensors in torch ops (torch.optim's first step imports its compiler
    stack, seconds of start-up that are no part of the update rate)."""
    p, g, m, v = (device.zeros(numel, torch.float32) for _ in range(4))
    g.fill_(1e-3)

    def run() -> None:
        p.mul_(1 - 1e-4)
        m.lerp_(g, 0.1)
        v.mul_(0.95).addcmul_(g, g, value=0.05)
        p.addcdiv_(m, v.sqrt().div_(0.3).add_(1e-8), value=-1e-3)
    return run


def device_update_rate(device: DeviceLayer, numel: int = 1 << 19, repeats: int = 2) -> float:
    """Ug: fp32 AdamW parameters per second on the device (torch ops)."""
    sync = (lambda: torch.cuda.synchronize(device.torch_device)) if device.kind == "cuda" else (lambda: None)
    with device.on(device.compute_stream):
        return _rate(numel, _device_adam(device, numel), sync, repeats)


def h2d_rate(device: DeviceLayer, numel: int = 1 << 19, repeats: int = 2) -> float:
    """B: fp32 parameters per second from a pinned buffer through the H2D stream."""
    host = device.pin_host(numel, torch.float32)
    host.fill_(1.0)
    dev = device.empty(numel, torch.float32)
    pending = []

    def h2d() -> None:
        pending.append(device.copy_async(dev, host, device.h2d_stream))

    def h2d_done() -> None:
        while pending:
            pending.pop().wait()
    return _rate(numel, h2d, h2d_done, repeats)


def downscale_rate(numel: int = 1 << 19, repeats: int = 2) -> float:
    """Dc: fp32 -> bf16 conversions per second on the host."""
    full = torch.ones(numel)
    half = torch.empty(numel, dtype=torch.bfloat16)
    return _rate(numel, lambda: half.copy_(full), lambda: None, repeats)


def _seconds(run: Callable[[], Callable[[], None]], trials: int = 3) -> float:
    """The least of `trials` timings of `run()` and the wait it returns: the figure least
    disturbed by whatever else the machine runs."""
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        run()()
        best = min(best, time.perf_counter() - start)
    return best


class _SubgroupChain:
    """Subgroups of host state streamed through the device updater, as a stride places them:
    each subgroup of a batch with host state of its own, as a stage's subgroups have (a
    subgroup's load must not read what the one before it still flushes; the stream
    sanitizer tracks a pinned buffer as a whole)."""

    HYPER = AdamHyper.of(1e-4, (0.9, 0.95), 1e-8, 0.0, step=1, inv_scale=1.0, clip=0.0)

    def __init__(self, device: DeviceLayer, numel: int) -> None:
        self.device = device
        self.updater = DeviceSubgroupUpdater(device, numel)
        self._states: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}

    def _subgroup_state(self, size: int) -> tuple[torch.Tensor, ...]:
        """p, m, v, a gradient (fp32) and the 16-bit copy of one subgroup, pinned."""
        p, m, v, g = (self.device.pin_host(size, torch.float32) for _ in range(4))
        for t in (p, m, v):
            t.fill_(0.0)
        g.fill_(1e-3)
        return p, m, v, g, self.device.pin_host(size, torch.bfloat16)

    def launch(self, count: int, size: int) -> Callable[[], None]:
        """`count` subgroups of `size` launched back to back, each on its own host state (made
        once per batch shape); returns the wait for them."""
        size = min(size, self.updater.max_numel)
        if (count, size) not in self._states:
            self._states[count, size] = [self._subgroup_state(size) for _ in range(count)]
        launched = [self.updater.launch(*state, self.HYPER)
                    for state in self._states[count, size]]
        return lambda: [one.result() for one in launched] and None


@dataclass(frozen=True)
class Mechanism:
    """What the device subgroups' real mechanism costs, beside the C++ kernel."""

    params_per_s: float  # the device side's throughput, subgroups launched back to back
    overhead_s: float  # its fixed cost per subgroup
    overlap: float  # the share of the shorter side hidden when both run at once


def measure_mechanism(device: DeviceLayer, adam: CPUAdamW, numel: int,
                      count: int = 2) -> Mechanism:
    """The device side: `count` subgroups of `numel` and 16 times as many of MIN_SUBGROUP
    (or an eighth of `numel`),
    each batch launched back to back as a stride does; the line through the two gives the
    throughput and the fixed cost. The overlap: the device's `count` subgroups and as many
    C++ steps of `numel` as take as long, alone and at once: (alone + alone - together) /
    the shorter (sides of equal length, so that neither's noise swamps the other)."""
    chain = _SubgroupChain(device, numel)
    grad = torch.full((numel,), 1e-3)
    small, many = max(1, min(MIN_SUBGROUP, numel // 8)), 16 * count
    chain.launch(1, numel)()  # warm-up: the streams' threads, the slots' first touch
    big_s = _seconds(lambda: chain.launch(count, numel)) / count
    small_s = _seconds(lambda: chain.launch(many, small)) / many
    per_param = (big_s - small_s) / (numel - small)
    if per_param <= 0:  # noise: the big batch no slower than the small
        per_param, overhead_s = big_s / numel, 0.0
    else:
        overhead_s = max(0.0, small_s - small * per_param)

    def cpu_steps(steps: int) -> Callable[[], None]:
        for _ in range(steps):
            adam.step_group(0, grad)
        return lambda: None
    step_s = _seconds(lambda: cpu_steps(1))
    steps = max(1, min(1000, round(count * big_s / step_s))) if step_s > 0 else 1

    def both() -> Callable[[], None]:
        wait = chain.launch(count, numel)
        cpu_steps(steps)
        return wait
    device_s, cpu_s = count * big_s, _seconds(lambda: cpu_steps(steps))
    both_s = _seconds(both)
    shorter = min(device_s, cpu_s)
    overlap = min(1.0, max(0.0, (device_s + cpu_s - both_s) / shorter)) if shorter > 0 else 1.0
    return Mechanism(1.0 / per_param, overhead_s, overlap)


def measure_update_rates(device: DeviceLayer, threads: int, numel: int = CALIBRATION_NUMEL,
                         repeats: int = 2) -> UpdateRates:
    """Measures B, Ug, Uc, Dc and the mechanism's overlap and fixed cost per subgroup
    (about a second for the default size on a laptop). Device memory: at most the two
    subgroup slots of `numel` parameters (subgroup_slots_bytes), one measurement's buffers
    at a time, so that it fits where subgroups of `numel` do."""
    b = h2d_rate(device, numel, repeats)
    ug = device_update_rate(device, numel, repeats)
    adam = CPUAdamW([torch.zeros(numel)], threads=threads)
    grad = torch.full((numel,), 1e-3)
    uc = _rate(numel, lambda: adam.step_group(0, grad), lambda: None, repeats)
    mechanism = measure_mechanism(device, adam, numel)
    return UpdateRates(b, ug, uc, downscale_rate(numel, repeats), mechanism.overlap,
                       mechanism.overhead_s, mechanism.params_per_s)


def machine_key(device: DeviceLayer, threads: int) -> str:
    name = torch.cuda.get_device_name(device.torch_device) if device.kind == "cuda" else "cpu"
    raw = f"{platform.node()}-{platform.machine()}-{name}-t{threads}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def calibrated_update_rates(device: DeviceLayer, threads: int, cache_dir: str,
                            log: Callable[[str], None] = print,
                            subgroup: int = CALIBRATION_NUMEL) -> UpdateRates:
    """The cached rates of this machine, measured (and cached) on first use; logged.
    Measured with at most `subgroup` parameters (the run's subgroup size: the device memory
    it has holds their slots)."""
    path = os.path.join(cache_dir, f"optimizer-rates-{machine_key(device, threads)}.json")
    rates = None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("version") == CACHE_VERSION:
            rates = UpdateRates(**saved["rates"])
    except (OSError, ValueError, TypeError, KeyError):
        rates = None
    source = f"cached in {path}"
    if rates is None:
        start = time.perf_counter()
        rates = measure_update_rates(device, threads, min(CALIBRATION_NUMEL, subgroup))
        os.makedirs(cache_dir, exist_ok=True)
        payload = json.dumps({"version": CACHE_VERSION, "rates": rates.__dict__}).encode()
        atomic_write(path, lambda f: f.write(payload))
        source = f"measured in {time.perf_counter() - start:.2f} s, cached in {path}"
    log("optimizer update rates (params/s): "
        f"h2d {rates.h2d_params_per_s:.3g}, device update {rates.gpu_update_params_per_s:.3g}, "
        f"cpu update {rates.cpu_update_params_per_s:.3g}, "
        f"downscale {rates.downscale_params_per_s:.3g}; device subgroups "
        f"{rates.device_subgroup_params_per_s or 0:.3g} and {rates.subgroup_overhead_s * 1e6:.0f} "
        f"us each, overlapping the CPU's {rates.overlap:.2f} ({source})")
    return rates


def update_rates_here(choice: DeviceChoice | None, threads: int, cache_dir: str,
                      log: Callable[[str], None] = print,
                      subgroup: int = CALIBRATION_NUMEL) -> UpdateRates:
    """calibrated_update_rates on this process's device (`choice`; None: the machine's),
    through a device layer of its own: the run's plan resolves --optimizer-gpu-stride auto
    with them before the pipeline exists."""
    kind, index = (choice.kind, choice.index) if choice else (None, None)
    with get_device(kind=kind, index=index) as device:
        return calibrated_update_rates(device, threads, cache_dir, log, subgroup)
