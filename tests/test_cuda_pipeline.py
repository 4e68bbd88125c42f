"""On a GPU: every way of training runs on CUDA as it runs on the CPU device layer.

Each case trains a small model twice, on the GPU and with CUDA_VISIBLE_DEVICES="" on the
CPU device layer, and compares what a user reads: the losses (fp32 within 1e-4; bf16 and
fp16 within 1e-2, their rounding differs between the devices), the host synchronisations
and the device-memory books per iteration, and, in fp16, the skipped iterations. The CPU
runs play this GPU (MEGATRON_CPU_DEVICE_GPU): core attention takes the kernel CUDA takes on
it (megatron.config.attention_kernel), math pinned on both for fp32 with grouped-query
attention, flash or cuDNN in bf16 and fp16, which the CPU computes with its flash kernel
keeping what the CUDA kernel keeps; so the books are equal. The cases:
every schedule at one rank (the one-process path `single` included), bf16 (its host
gradients in fp32 and in bf16), fp16, GPU optimizer subgroups (a stride and device:N), a
resident fraction, optimizer states on NVMe, and two ranks sharing the one GPU
(--share-gpu: gloo, point-to-point staged through pinned
host memory). All the selected runs start together, a few at a time, so the module costs
about the time of its slowest few runs. Skipped without CUDA (docs/gpu-validation.md).
"""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import gpu_check_steps  # noqa: E402

from megatron.config.attention_kernel import CPU_DEVICE_GPU_ENV  # noqa: E402

pytestmark = pytest.mark.cuda

RUN = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "160",
       "--num-attention-heads", "4", "--group-query-attention",
       "--num-query-groups", "2", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
       "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0", "--log-interval", "1",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
       "--eval-iters", "0"]
DECOUPLED = ["--pipeline-schedule", "decoupled", "--forward-stages", "4", "--backward-split", "2"]
FP32_RTOL, HALF_RTOL = 1e-4, 1e-2
NVME = "{nvme}"  # replaced by the test's directory
# name: (flags, processes, loss tolerance)
CASES = {
    "single": (["--pipeline-schedule", "single"], 1, FP32_RTOL),
    "gpipe": (["--pipeline-schedule", "gpipe"], 1, FP32_RTOL),
    "1f1b": (["--pipeline-schedule", "1f1b"], 1, FP32_RTOL),
    "interleaved-1f1b": (["--pipeline-schedule", "interleaved-1f1b", "--forward-stages", "4"],
                         1, FP32_RTOL),
    "mobius": (["--pipeline-schedule", "mobius", "--forward-stages", "4"], 1, FP32_RTOL),
    "decoupled": (DECOUPLED, 1, FP32_RTOL),
    "decoupled-bf16": ([*DECOUPLED, "--bf16"], 1, HALF_RTOL),
    # the host gradients in bf16 on CUDA as well (fp32 by default there)
    "decoupled-bf16-host-gradients": ([*DECOUPLED, "--bf16", "--grad-reduce-in-bf16"], 1,
                                      HALF_RTOL),
    "decoupled-fp16": ([*DECOUPLED, "--fp16"], 1, HALF_RTOL),
    "gpu-stride": ([*DECOUPLED, "--optimizer-gpu-stride", "2"], 1, FP32_RTOL),
    "gpu-device-n": ([*DECOUPLED, "--optimizer-gpu-stride", "device:2"], 1, FP32_RTOL),
    "resident-fraction": ([*DECOUPLED, "--optimizer-gpu-resident-fraction", "0.25"], 1,
                          FP32_RTOL),
    "nvme": ([*DECOUPLED, "--optimizer-state-location", "nvme", "--optimizer-nvme-path", NVME],
             1, FP32_RTOL),
    "two-ranks-share-the-gpu": (DECOUPLED, 2, FP32_RTOL),
}
PARALLEL_RUNS = 8
RUN_TIMEOUT_S = 240


def _job(workdir, case, device, this_gpu):
    flags, processes, _ = CASES[case]
    nvme = os.path.join(workdir, f"nvme-{case}-{device}")
    os.makedirs(nvme, exist_ok=True)
    flags = [nvme if f == NVME else f for f in flags]
    env = {"OMP_NUM_THREADS": "2"}
    if device == "cpu":  # the CPU device layer, playing this GPU
        env.update({**gpu_check_steps.CPU_ONLY, CPU_DEVICE_GPU_ENV: this_gpu})
    launcher = None
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(processes)]
        # the test mode that lets the ranks share one GPU; each CPU rank plays its own
        flags = [*flags, *(["--share-gpu"] if device == "gpu" else [])]
    return lambda: gpu_check_steps.train(workdir, f"{case}-{device}", [*RUN, *flags], env,
                                         launcher, timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case's GPU and CPU run, started together a few at a time."""
    from megatron.models.attention import cuda_gpu

    this_gpu = cuda_gpu(0).describe()
    workdir = str(tmp_path_factory.mktemp("cuda-pipeline"))
    selected = sorted({item.callspec.params["case"] for item in request.session.items
                       if item.module is request.module and hasattr(item, "callspec")})
    jobs = {(case, device): _job(workdir, case, device, this_gpu)
            for case in selected for device in ("gpu", "cpu")}
    return gpu_check_steps.run_concurrently(jobs, PARALLEL_RUNS)


@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_trains_as_the_cpu_device_layer(runs, case):
    (gpu_proc, gpu), (cpu_proc, cpu) = runs[(case, "gpu")], runs[(case, "cpu")]
    assert gpu_proc.returncode == 0, gpu_check_steps.tail(gpu_proc, 3000)
    assert cpu_proc.returncode == 0, gpu_check_steps.tail(cpu_proc, 3000)
    assert [m["iteration"] for m in gpu] == [m["iteration"] for m in cpu] == [1, 2, 3, 4]
    rtol = CASES[case][2]
    for a, b in zip(gpu, cpu):
        assert math.isfinite(a["loss"])
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), (a["iteration"], a["loss"],
                                                                 b["loss"])
        for books in ("host_syncs", "skipped"):
            assert a.get(books) == b.get(books), (a["iteration"], books)
        # The same tensors are counted on both layers: RMSNorm's (one autograd function
        # keeps the input and one scalar per row on both, megatron.models.rms_norm; torch's
        # RMSNorm made the CPU's book 1.1 % larger here) and core attention's (the same
        # kernel's, its RNG state included: fp32 here took math on CUDA and flash on the
        # CPU before the kernel was pinned, 2.4 % apart).
        assert a.get("attention_kernel") == b.get("attention_kernel"), a["iteration"]
        if b.get("device_memory_peak_bytes") is not None:
            assert a["device_memory_peak_bytes"] == b["device_memory_peak_bytes"], \
                (a["iteration"], a["device_memory_peak_bytes"], b["device_memory_peak_bytes"])
