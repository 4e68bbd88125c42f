"""Datasheet peaks of GPUs: dense (no sparsity) tensor-core throughput in bf16 and fp16.

The denominator of model FLOPs utilization (MFU) for a GPU that was not profiled: the
vendor's number, not a measurement. Looked up by a substring of the name CUDA reports
(`torch.cuda.get_device_name`), first match wins, so the more specific names come first
("H100 PCIe" before "H100", "L40S" before "L40" before "L4").
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class GpuPeak:
    name_contains: str
    bf16_flops: float | None  # None: no bf16 tensor cores
    fp16_flops: float

    def flops(self, dtype: str) -> float | None:
        """The peak for `dtype` ("bf16" or "fp16")."""
        if dtype not in ("bf16", "fp16"):
            raise ValueError(f"dtype is {dtype!r}, expected 'bf16' or 'fp16'")
        return self.bf16_flops if dtype == "bf16" else self.fp16_flops


# NVIDIA's and AMD's datasheets, dense figures (the sparse ones are twice these).
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("GB200", 2500 * TERA, 2500 * TERA),
    GpuPeak("B200", 2250 * TERA, 2250 * TERA),
    GpuPeak("B100", 1750 * TERA, 1750 * TERA),
    GpuPeak("GH200", 989 * TERA, 989 * TERA),
    GpuPeak("H200 NVL", 835 * TERA, 835 * TERA),
    GpuPeak("H200", 989 * TERA, 989 * TERA),
    GpuPeak("H100 PCIe", 756 * TERA, 756 * TERA),
    GpuPeak("H100 NVL", 835 * TERA, 835 * TERA),
    GpuPeak("H100", 989 * TERA, 989 * TERA),  # SXM: "NVIDIA H100 80GB HBM3"
    GpuPeak("H800", 989 * TERA, 989 * TERA),
    GpuPeak("A100", 312 * TERA, 312 * TERA),
    GpuPeak("A800", 312 * TERA, 312 * TERA),
    GpuPeak("L40S", 362 * TERA, 362 * TERA),
    GpuPeak("L40", 181 * TERA, 181 * TERA),
    GpuPeak("L4", 121 * TERA, 121 * TERA),
    GpuPeak("A10", 125 * TERA, 125 * TERA),
    GpuPeak("V100S", None, 130 * TERA),
    GpuPeak("V100-PCIE", None, 112 * TERA),
    GpuPeak("V100", None, 125 * TERA),
    GpuPeak("MI300X", 1307 * TERA, 1307 * TERA),
    GpuPeak("MI250X", 383 * TERA, 383 * TERA),
)


def gpu_peak(device_name: str) -> GpuPeak | None:
    """The table's entry for the GPU CUDA calls `device_name`, or None for one it lacks."""
    lowered = device_name.lower()
    for peak in GPU_PEAKS:
        if peak.name_contains.lower() in lowered:
            return peak
    return None


def datasheet_peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense `dtype` ("bf16"/"fp16") FLOP/s of that GPU by its datasheet; None when the
    table does not know the GPU or the GPU lacks that precision."""
    peak = gpu_peak(device_name)
    return peak.flops(dtype) if peak is not None else None
