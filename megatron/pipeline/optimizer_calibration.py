"""The four throughputs of the optimizer-stride model (Eq. 1), measured on this machine
in a short start-up calibration and cached per machine.

B: fp32 parameters per second host -> device through the device layer's H2D stream from a
pinned buffer; Ug: the device's AdamW update rate (in torch ops); Uc: the C++ kernel's update rate (no working copy); Dc: the
fp32 -> 16-bit conversion rate on the CPU. On the CPU device layer "device" means the
same cores, so the figures describe the mechanism, not a GPU.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable

import torch

from megatron.common.files import atomic_write
from megatron.offload.device import DeviceLayer
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.schedules.optimizer_stride import UpdateRates

CACHE_VERSION = 1


def _rate(numel: int, run: Callable[[], None], finish: Callable[[], None], repeats: int) -> float:
    run()  # warm-up
    finish()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    finish()
    return numel * repeats / (time.perf_counter() - start)


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


def downscale_rate(numel: int = 1 << 19, repeats: int = 2) -> float:
    """Dc: fp32 -> bf16 conversions per second on the host."""
    full = torch.ones(numel)
    half = torch.empty(numel, dtype=torch.bfloat16)
    return _rate(numel, lambda: half.copy_(full), lambda: None, repeats)


def measure_update_rates(device: DeviceLayer, threads: int, numel: int = 1 << 19,
                         repeats: int = 2) -> UpdateRates:
    """Measures B, Ug, Uc, Dc (well under a second for the default size on a laptop)."""
    host = device.pin_host(numel, torch.float32)
    host.fill_(1.0)
    dev = device.empty(numel, torch.float32)
    pending = []

    def h2d() -> None:
        pending.append(device.copy_async(dev, host, device.h2d_stream))

    def h2d_done() -> None:
        while pending:
            pending.pop().wait()
    b = _rate(numel, h2d, h2d_done, repeats)
    ug = device_update_rate(device, numel, repeats)
    adam = CPUAdamW([torch.zeros(numel)], threads=threads)
    grad = torch.full((numel,), 1e-3)
    uc = _rate(numel, lambda: adam.step_group(0, grad), lambda: None, repeats)
    return UpdateRates(b, ug, uc, downscale_rate(numel, repeats))


def machine_key(device: DeviceLayer, threads: int) -> str:
    name = torch.cuda.get_device_name(device.torch_device) if device.kind == "cuda" else "cpu"
    raw = f"{platform.node()}-{platform.machine()}-{name}-t{threads}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def calibrated_update_rates(device: DeviceLayer, threads: int, cache_dir: str,
                            log: Callable[[str], None] = print) -> UpdateRates:
    """The cached rates of this machine, measured (and cached) on first use; logged."""
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
        rates = measure_update_rates(device, threads)
        os.makedirs(cache_dir, exist_ok=True)
        payload = json.dumps({"version": CACHE_VERSION, "rates": rates.__dict__}).encode()
        atomic_write(path, lambda f: f.write(payload))
        source = f"measured in {time.perf_counter() - start:.2f} s, cached in {path}"
    log("optimizer update rates (params/s): "
        f"h2d {rates.h2d_params_per_s:.3g}, device update {rates.gpu_update_params_per_s:.3g}, "
        f"cpu update {rates.cpu_update_params_per_s:.3g}, "
        f"downscale {rates.downscale_params_per_s:.3g} ({source})")
    return rates
