#!/usr/bin/env python3
"""Measure this machine and write a hardware profile (JSON) for --plan and --auto-config.

    tools/profile_hardware.py --out hw.json [--gpus-per-node N] [--rounds R] MODEL FLAGS
    pretrain_llama.py --plan --hardware hw.json MODEL FLAGS ...

MODEL FLAGS are pretrain_llama.py's (`--model-preset 1b --seq-length 2048
--micro-batch-size 2 --bf16`, or the sizes `--num-layers --hidden-size ...`; default: the
small preset): compute is measured at that model's decoder layer, which is what --plan
prices. One progress line per measurement on stderr; well under a minute. Measured: host -> device
and device -> host copies from pinned and from shared-memory buffers, the C++ CPU AdamW
update rate at the thread count training would use (cores / GPUs per node, all GPUs'
processes together), host memory bandwidth, AdamW on the device (torch ops) and the host's
fp32 -> bf16 conversion (the optimizer GPU stride's rates), the optimizer subgroups'
mechanism as --optimizer-gpu-stride auto measures it at start-up (throughput, fixed cost
per subgroup, overlap with the C++ AdamW), the device's matmul throughput at the model's
shapes: one decoder layer's forward at micro-batches 1, the model's and twice it, in
interleaved rounds (the profile keeps their spread), fitted to the cost model's
efficiency curve (on CUDA the GPU's; on the CPU device layer the CPU's, measured by one process
per GPU at once, as training shares the cores), a one-layer stage's FORWARD and BACKWARD
instructions: the backward's time over the forward's (backward_over_forward, the recompute
taken out), and the FORWARD's time, which sets the curve's level at the run's micro-batch
(pass_overhead_s stays 0: the two time one layer), alternating with them a head stage's
(final norm, output layer to the vocabulary of --vocab-size or LLaMA-2's, loss): its rate
over the layer's and its backward's ratio, and an embedding stage's (printed only), half a
small round trip between two GPUs' processes posted as the executor posts its transfers
(p2p_latency_s), the executor's host time per instruction beyond its compute and its
one-layer stage's FORWARD and BACKWARD over the same stage's timed alone, from a
one-process pipeline of the model's layers in each process at once (instruction_overhead_s,
executor_compute_over_pass), the bandwidth between two
devices (two GPUs when there are; on the CPU layer the loopback socket gloo would use);
free /dev/shm, host memory and `ulimit -l`. With --nvme-path DIR, the drive for optimizer
states on NVMe: O_DIRECT sequential write then read of a temporary file in DIR through the
state-file engine, and DIR's free bytes as the capacity. The fields are those of the
built-in profiles (megatron/schedules/hardware_profiles/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import mmap
import os
import platform
import re
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron-core warns at import that the GPU-only Apex / Transformer Engine are absent: 8
# lines on stderr before a bad input's one (pretrain_llama.py filters them the same way)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.nvme_optimizer import filesystem_of  # noqa: E402
from megatron.common.files import atomic_write, make_parent_dir  # noqa: E402
from megatron.common.ports import reserved_port  # noqa: E402
from megatron.common.process_memory import memory_status  # noqa: E402
from megatron.config.errors import ConfigError  # noqa: E402
from megatron.config.model import MODEL_FIELDS, ModelConfig  # noqa: E402
from megatron.config.output_paths import check_writable_file  # noqa: E402
from megatron.config.run import RunConfig  # noqa: E402
from megatron.models.llama import LlamaConfig, build_piece  # noqa: E402
from megatron.offload.device import get_device  # noqa: E402
from megatron.offload.shm_space import DEFAULT_SHM_DIR, free_bytes  # noqa: E402
from megatron.optimizer.cpu_adam import CPUAdamW, usable_cores  # noqa: E402
from megatron.optimizer.state_io import (  # noqa: E402
    StateFile,
    aligned_empty,
    direct_io_supported,
    disk_free_bytes,
    shared_engine,
)
from megatron.pipeline.executor import OPTIMIZER_OPS  # noqa: E402
from megatron.pipeline.optimizer_calibration import (  # noqa: E402
    CALIBRATION_NUMEL,
    device_update_rate,
    downscale_rate,
    measure_mechanism,
)
from megatron.schedules.cost_model import (  # noqa: E402
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
)
from megatron.schedules.gpu_peaks import datasheet_peak_flops  # noqa: E402
from megatron.schedules.hardware import (  # noqa: E402
    HardwareProfile,
    fit_efficiency_curve,
    layer_shape,
)
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.pipeline_step import PipelineTrainStep  # noqa: E402

MIB = 2**20
# the pieces a stage's FORWARD and BACKWARD are timed for: a decoder layer (the compute's
# level), the head (its own rate) and the embedding (shown, not priced)
PIECES = ("layer", "head", "embedding")


def progress(text: str) -> None:
    print(f"profile_hardware: {text}", file=sys.stderr, flush=True)


def best_rate(work: Callable[[], None], amount: float, repeats: int = 3,
              pick: Callable[[list[float]], float] = min) -> float:
    """`amount` per second of the fastest of `repeats` runs after one warm-up (`pick`:
    another choice of the runs' seconds, e.g. their median)."""
    work()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return amount / pick(times)


def copy_rates(device, nbytes: int) -> tuple[float, float, float]:
    """H2D and D2H from pinned host memory, H2D from a /dev/shm mapping (bytes/s)."""
    numel = nbytes // 2
    on_device = device.empty(numel, torch.float16)
    pinned = device.pin_host(numel, torch.float16)
    pinned.fill_(1.0)

    def copy(dst, src, stream):
        def run():
            device.copy_async(dst, src, stream).wait()
        return run

    h2d = best_rate(copy(on_device, pinned, device.h2d_stream), nbytes)
    d2h = best_rate(copy(pinned, on_device, device.d2h_stream), nbytes)
    path = os.path.join(DEFAULT_SHM_DIR, f"profile-hardware-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            shared = torch.frombuffer(mm, dtype=torch.float16, count=numel)
            shared.fill_(1.0)
            registered = device.kind == "cuda" and _register(shared)
            try:
                h2d_shm = best_rate(copy(on_device, shared, device.h2d_stream), nbytes)
            finally:
                if registered:
                    torch.cuda.cudart().cudaHostUnregister(shared.data_ptr())
            del shared
    finally:
        os.close(fd)
        os.unlink(path)
    return h2d, d2h, h2d_shm


def _register(tensor: torch.Tensor) -> bool:
    """Page-lock a shared mapping as the parameter store does on CUDA."""
    return torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0) == 0


def adam_rate(threads: int, numel: int) -> float:
    """Parameters per second of one process's C++ AdamW (bf16 gradients and output)."""
    master = torch.randn(numel)
    adam = CPUAdamW([master], lr=1e-4, threads=threads, weight_decay=0.1)
    grad = torch.randn(numel).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)

    def step():
        adam.step_group(0, grad, out=out)
        adam.commit_group(0)
    return best_rate(step, numel)


def memory_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a large copy."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return best_rate(lambda: dst.copy_(src), 2 * nbytes)


def matmul_flops(device, hidden: int, ffn: int, tokens: int, dtype: torch.dtype) -> float:
    """Flops/s of the model's largest matmul (tokens x hidden @ hidden x ffn)."""
    a = torch.randn(tokens, hidden, device=device.torch_device).to(dtype)
    b = torch.randn(hidden, ffn, device=device.torch_device).to(dtype)

    def run():
        torch.matmul(a, b)
        if device.kind == "cuda":
            torch.cuda.synchronize()
    return best_rate(run, 2.0 * tokens * hidden * ffn)


def model_piece(device, model: ModelConfig, dtype: torch.dtype, micro_batch: int,
                piece: str = "layer") -> tuple[torch.nn.Module, torch.Tensor]:
    """One piece of `model` on the device, a decoder layer ("layer": its sizes and
    attention kernel), the "head" or the "embedding", and a hidden input of `micro_batch`
    sequences."""
    cfg = LlamaConfig.from_model(model, model.planned_vocab_size, seed=1)
    index = {"embedding": 0, "layer": 1, "head": cfg.num_layers + 1}[piece]
    module = build_piece(cfg, index).to(device.torch_device, dtype)  # 1: decoder layer 0
    return module, layer_input(device, model, dtype, micro_batch)


def layer_input(device, model: ModelConfig, dtype: torch.dtype, micro_batch: int) -> torch.Tensor:
    return torch.randn(model.seq_length, micro_batch, model.hidden_size,
                       device=device.torch_device).to(dtype)


def layer_rates(device, model: ModelConfig, dtype: torch.dtype, batches: tuple[int, ...],
                rounds: int, budget_s: float = 0.3, ready: Callable[[], None] = lambda: None
                ) -> dict[int, list[float]]:
    """Flops/s of one decoder layer's forward at `model`'s shapes, as the cost model counts
    its flops (the real per-micro-batch cost, small-batch overheads included), per
    micro-batch size: one rate per round, each the median of as many passes (3 to 50) as
    fit in about `budget_s`. The sizes take turns within a round, so a change of the
    machine's load touches them alike. `ready` is called once the layer is built, before
    the timing (processes measuring at once meet there)."""
    layer, _ = model_piece(device, model, dtype, 1)
    inputs = {b: layer_input(device, model, dtype, b) for b in batches}
    ready()

    def run(hidden):
        def forward():
            with torch.no_grad():
                layer(hidden, {})
            if device.kind == "cuda":
                torch.cuda.synchronize()
        return forward
    flops_per_token = layer_forward_flops_per_token(model, model.seq_length)
    repeats = {}
    for b in batches:  # a warm-up pass, timed, sizes each point's repeats
        t0 = time.perf_counter()
        run(inputs[b])()
        repeats[b] = min(50, max(3, int(budget_s / (time.perf_counter() - t0))))
    rates: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(rounds):
        for b in batches:
            # the median, not the fastest: the typical pass of a training run
            rates[b].append(best_rate(run(inputs[b]), flops_per_token * b * model.seq_length,
                                      repeats=repeats[b], pick=statistics.median))
    return rates


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart repeated measurements of one quantity are."""
    return (max(values) - min(values)) / statistics.median(values)


def synthetic_batch(vocab_size: int, micro_batch: int, seq_length: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch of random tokens, its labels the next tokens, every token counted."""
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_length), device=device)
    return {"tokens": tokens, "labels": tokens.roll(-1, dims=1),
            "loss_mask": torch.ones(micro_batch, seq_length, device=device)}


def stage_passes(device, model: ModelConfig, dtype: torch.dtype, micro_batch: int,
                 piece: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A FORWARD and a BACKWARD instruction of a stage holding one `piece` of `model` at
    `micro_batch`, as the executor runs them: the forward without autograd; the backward
    recomputing from its input checkpoint and back-propagating into the parameters'
    gradients: from the next stage's gradient ("layer": one decoder layer), from the loss
    ("head": the final norm, the output layer to the vocabulary and the cross-entropy), or
    from the first layer's gradient into the table ("embedding", its input the tokens)."""
    module, hidden = model_piece(device, model, dtype, micro_batch, piece)
    batch = synthetic_batch(model.planned_vocab_size, micro_batch, model.seq_length,
                            device.torch_device)
    grad_out = torch.randn_like(hidden)

    def forward() -> None:
        with torch.no_grad():
            module(None if piece == "embedding" else hidden, batch)

    def backward() -> None:
        checkpoint = None if piece == "embedding" else hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            out = module(checkpoint, batch)
            out.backward(None if piece == "head" else grad_out)  # the loss: a scalar
    return forward, backward


def timed(device, work: Callable[[], None]) -> float:
    """Seconds of `work` between events recorded on the device's compute stream."""
    begin = device.compute_stream.record_event()
    work()
    end = device.compute_stream.record_event()
    return end.time_s() - begin.time_s()


def pass_times(device, model: ModelConfig, dtype: torch.dtype, micro_batch: int,
               budget_s: float = 3.0, ready: Callable[[], None] = lambda: None,
               pieces: tuple[str, ...] = ("layer",)) -> dict[str, tuple[float, float]]:
    """Median seconds of a FORWARD and of a BACKWARD instruction of a stage holding one of
    each of `pieces` (stage_passes), per piece: timed between events recorded on the
    compute stream. All alternate, forward and backward, piece after piece (a change of
    the machine's load touches them alike), 9 to 41 rounds, as many as fit in about
    `budget_s`. `ready`: as layer_rates'."""
    stages = {piece: stage_passes(device, model, dtype, micro_batch, piece)
              for piece in pieces}
    ready()

    def one_round() -> dict[str, tuple[float, float]]:
        return {piece: (timed(device, forward), timed(device, backward))
                for piece, (forward, backward) in stages.items()}
    first = sum(f + b for f, b in one_round().values())  # a warm-up
    rounds = [one_round() for _ in range(min(41, max(9, int(budget_s / first))))]
    return {piece: (statistics.median(r[piece][0] for r in rounds),
                    statistics.median(r[piece][1] for r in rounds)) for piece in pieces}


def backward_over_forward(forward_s: float, backward_s: float) -> float:
    """A one-layer stage's BACKWARD (its recompute, one forward, taken out) over its
    FORWARD, from pass_times' two medians."""
    return max(0.0, backward_s / forward_s - 1.0)


def peak_at_forward(model: ModelConfig, micro_batch: int, half_tokens: float,
                    max_efficiency: float, forward_s: float) -> float:
    """The efficiency curve's peak that prices one decoder layer's forward at
    `micro_batch` at the measured FORWARD `forward_s` (the curve's shape, its half tokens
    and maximum efficiency, kept): the FORWARD sets the curve's level at the run's
    micro-batch."""
    tokens = micro_batch * model.seq_length
    return (layer_forward_flops_per_token(model, model.seq_length) * (tokens + half_tokens)
            / (max_efficiency * forward_s))


def head_over_layer(model: ModelConfig, layer: tuple[float, float],
                    head: tuple[float, float]) -> tuple[float, float]:
    """The profile's head_rate_over_layer and head_backward_over_forward from pass_times'
    (FORWARD, BACKWARD) of a one-layer stage and of a head stage at the same tokens: the
    head's flops per second of its FORWARD over the layer's, as the cost model counts
    their flops, and its BACKWARD (the recompute taken out) over its FORWARD."""
    layer_rate = layer_forward_flops_per_token(model, model.seq_length) / layer[0]
    head_rate = head_forward_flops_per_token(model) / head[0]
    return head_rate / layer_rate, backward_over_forward(*head)


def with_pass_times(hardware: HardwareProfile, model: ModelConfig, micro_batch: int,
                    forward_s: float, backward_s: float) -> HardwareProfile:
    """`hardware` with its compute's level and backward ratio taken from a one-layer
    stage's FORWARD and BACKWARD measured now (pass_times at the run's shape): how a
    profile's compute is brought up to date right before the run it prices, with the
    rest of the profile (its curve's shape, copies, optimizer, latencies) as measured."""
    return dataclasses.replace(
        hardware,
        gpu_peak_flops=peak_at_forward(model, micro_batch, hardware.efficiency_half_tokens,
                                       hardware.gpu_max_efficiency, forward_s),
        backward_over_forward=backward_over_forward(forward_s, backward_s))


def p2p_latency(device, peer: int, first: bool, round_trips: int = 200) -> float:
    """Half the median round trip of a one-element message with `peer`, posted as the
    executor posts its blocking transfers (a batch_isend_irecv of one operation, then its
    wait); `first`: this side sends first."""
    message = torch.zeros(1, device=device.torch_device)

    def post(op: Callable) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, message, peer)]):
            work.wait()
    times = []
    for i in range(round_trips + 10):  # 10 warm-up round trips
        t0 = time.perf_counter()
        for op in ((dist.isend, dist.irecv) if first else (dist.irecv, dist.isend)):
            post(op)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


# The one-process pipeline executor_times runs: one decoder layer a forward stage, the
# decoupled schedule's program (every kind of instruction a rank runs without a peer)
PROGRAM_STAGES = 4
PROGRAM_MICRO_BATCHES = 2


def executor_times(model_flags: list[str], model: ModelConfig, dtype: torch.dtype,
                   micro_batch: int, iterations: int = 6,
                   ready: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """The executor's host time per instruction beyond its compute, and a one-layer
    stage's FORWARD and BACKWARD instructions as it runs them over the same stage's passes
    timed alone: a one-process pipeline (the decoupled schedule, PROGRAM_STAGES forward
    stages of one layer of the model `model_flags` names, the first with the embedding,
    the last with the head, PROGRAM_MICRO_BATCHES micro-batches of `micro_batch`,
    synthetic tokens) trains `iterations` iterations, its copy and optimizer threads
    running as in training. With no peer to wait for, an iteration's time outside its
    FORWARD/BACKWARD instructions and its optimizer waits (the executor's bubble time) is
    the program's own dispatch: parameter slots filled and released, modules bound, events
    recorded, memory books kept, transfers posted; its median over the iterations after the
    first, over the instructions it covers (all but the optimizer's). The one-layer stage:
    the stages between the first and the last, their instructions' compute from each
    iteration's events, per micro-batch, over a one-layer stage's FORWARD and BACKWARD
    timed alone (stage_passes, `model` in `dtype`, the median of three) right after that
    iteration, so that the machine's drift touches both alike; the median of those ratios
    over the same iterations. Needs a one-process group. It holds four layers' parameters
    and optimizer states, the model's layer counted four times. `ready`: called once the
    pipeline is built, before the timing (processes measuring at once meet there)."""
    run = parse_args([*model_flags, "--num-layers", str(PROGRAM_STAGES),
                      "--pipeline-schedule", "decoupled",
                      "--forward-stages", str(PROGRAM_STAGES),
                      "--micro-batch-size", str(micro_batch),
                      "--global-batch-size", str(PROGRAM_MICRO_BATCHES * micro_batch)])
    dist_info = initialize_distributed()
    model_cfg = LlamaConfig.from_model(run.model, run.model.planned_vocab_size, seed=1)
    with contextlib.redirect_stdout(io.StringIO()):  # the plan it prints is not the profile's
        step = PipelineTrainStep(model_cfg, run, dist_info)
    device = get_device()  # the stage alone, beside the pipeline's own device layer
    try:
        forward, backward = stage_passes(device, model, dtype, micro_batch, "layer")
        batch = synthetic_batch(model_cfg.vocab_size, micro_batch, run.model.seq_length,
                                dist_info.torch_device)
        ready()
        bubbles, ratios = [], []
        layer_stages = range(1, PROGRAM_STAGES - 1)  # no embedding, no head
        for i in range(1, iterations + 1):
            report = step.pipeline.step(i, [batch] * PROGRAM_MICRO_BATCHES, 1e-5, 0.0,
                                        record_timeline=True)
            in_executor = (sum(e.end - e.start for e in report.events
                               if e.resource == "compute" and e.stage in layer_stages)
                           / (len(layer_stages) * PROGRAM_MICRO_BATCHES))
            alone = statistics.median(timed(device, forward) + timed(device, backward)
                                      for _ in range(3))
            if i > 1:  # the first: a warm-up
                bubbles.append(report.breakdown["bubble_time_s"])
                ratios.append(in_executor / alone)
        program = step.config.schedule.programs[0]
    finally:
        device.close()
        step.close()
    covered = sum(1 for ins in program if ins.op not in OPTIMIZER_OPS)
    return statistics.median(bubbles) / covered, statistics.median(ratios)


def compute_measurements(device, model: ModelConfig, dtype: torch.dtype,
                         batches: tuple[int, ...], rounds: int, micro_batch: int,
                         ready: Callable[[], None] = lambda: None
                         ) -> tuple[dict[int, list[float]], dict[str, tuple[float, float]]]:
    """The layer's rates per micro-batch and round (layer_rates) and the FORWARD and
    BACKWARD pass times at `micro_batch` of a stage holding a decoder layer, the head or
    the embedding (pass_times, PIECES)."""
    rates = layer_rates(device, model, dtype, batches, rounds, ready=ready)
    passes = pass_times(device, model, dtype, micro_batch, ready=ready, pieces=PIECES)
    ready()
    return rates, passes


def _pair_worker(rank: int, world: int, port: int, model_flags: list[str],
                 model: ModelConfig, dtype: torch.dtype, batches: tuple[int, ...],
                 rounds: int, micro_batch: int, ready, results) -> None:
    """One of `world` processes, each playing one GPU as training does: compute_measurements
    by all at once (on the CPU device layer they share the cores as the training processes
    do, with torchrun's one thread each unless OMP_NUM_THREADS says otherwise), then ranks
    0 and 1 ping-pong; then, each in a one-process group of its own, all at once again
    (they meet at `ready`), executor_times: the executor's instructions right after the
    passes alone."""
    launcher = dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    os.environ.update(LOCAL_RANK=str(rank), **launcher)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", category=UserWarning)
    initialize_distributed()
    device = get_device()
    try:
        rates, passes = compute_measurements(device, model, dtype, batches, rounds,
                                             micro_batch, ready=dist.barrier)
        dist.barrier()
        latency = (p2p_latency(device, 1 - rank, rank == 0) if world > 1 and rank < 2
                   else 0.0)
    finally:
        device.close()
        shutdown_distributed()
    # the executor's program in a one-process pipeline of this process's own, the GPU
    # still this process's: no launcher, so a group in this process alone (no port to
    # rendezvous at) and segments named by its pid
    for name in launcher:
        del os.environ[name]
    try:
        per_instruction, executor_over_pass = executor_times(
            model_flags, model, dtype, micro_batch, ready=ready.wait)
    finally:
        shutdown_distributed()
    results.put((rank, rates, passes, latency, per_instruction,
                 executor_over_pass))


@dataclasses.dataclass(frozen=True)
class ComputeMeasurements:
    """What the processes measured at once (means over them): the layer's rates per
    micro-batch, round by round; each piece's FORWARD and BACKWARD (pass_times); the
    point-to-point latency; the executor's host time per instruction and its one-layer
    stage's FORWARD and BACKWARD over the same stage's timed alone (executor_times over
    pass_times')."""

    rates: dict[int, list[float]]
    passes: dict[str, tuple[float, float]]
    latency_s: float
    instruction_s: float
    executor_compute_over_pass: float


def pair_measurements(processes: int, model_flags: list[str], model: ModelConfig,
                      dtype: torch.dtype, batches: tuple[int, ...], rounds: int,
                      micro_batch: int) -> ComputeMeasurements:
    """`processes` workers at once (see _pair_worker), one or more."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    ready = context.Barrier(processes)
    with reserved_port() as port:  # rank 0's store binds it once the workers have started
        workers = [context.Process(target=_pair_worker, args=(
            rank, processes, port, model_flags, model, dtype, batches, rounds, micro_batch,
            ready, results)) for rank in range(processes)]
        for worker in workers:
            worker.start()
        while any(w.is_alive() for w in workers):
            time.sleep(0.2)
            if any(w.exitcode not in (None, 0) for w in workers):
                ready.abort()  # the others stop at `ready` instead of waiting there for it
                break
        for worker in workers:
            worker.join()
    failed = [w.exitcode for w in workers if w.exitcode != 0]
    if failed:
        raise RuntimeError(f"a measuring process exited with status {failed[0]}")
    rows = [results.get() for _ in workers]
    rates = {b: [statistics.mean(row[1][b][r] for row in rows) for r in range(rounds)]
             for b in batches}
    passes = {piece: tuple(statistics.mean(row[2][piece][i] for row in rows) for i in (0, 1))
              for piece in PIECES}
    return ComputeMeasurements(rates, passes, max(row[3] for row in rows),
                               statistics.mean(row[4] for row in rows),
                               statistics.mean(row[5] for row in rows))


def loopback_rate(nbytes: int) -> float:
    """Bytes/s through a local TCP connection (what gloo moves between CPU ranks)."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(MIB)
    received = []

    def sink():
        conn, _ = server.accept()
        with conn:
            total = 0
            while total < nbytes:
                chunk = conn.recv(4 * MIB)
                if not chunk:
                    break
                total += len(chunk)
            received.append(total)
    thread = threading.Thread(target=sink)
    thread.start()
    try:
        with socket.create_connection(server.getsockname()) as client:
            t0 = time.perf_counter()
            for _ in range(nbytes // MIB):
                client.sendall(payload)
        thread.join()
        return nbytes / (time.perf_counter() - t0)
    finally:
        server.close()


def gpu_p2p_rate(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:0")
    dst = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:1")

    def run():
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
    return best_rate(run, nbytes)


def nvme_rates(directory: str, nbytes: int, repeats: int = 2) -> tuple[float, float]:
    """O_DIRECT sequential write (until fdatasync) and read bytes/s of a temporary file in
    `directory`, through the engine the optimizer states use; the best of `repeats`. The
    file is removed after."""
    if filesystem_of(directory) in ("tmpfs", "ramfs") or not direct_io_supported(directory):
        raise ValueError(f"{directory} is not on a drive that takes O_DIRECT: the rate "
                         "would be memory's, not the drive's")
    fd, path = tempfile.mkstemp(prefix=".profile-hardware-", suffix=".nvme", dir=directory)
    os.close(fd)
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))  # not all zeros
    write_s = read_s = float("inf")
    try:
        f = StateFile(path, buf.numel(), shared_engine())  # the runtime's engine (4 threads)
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                f.write_from(buf, 0).wait()
                os.fdatasync(f.fd)  # counts until the data is on the drive
                write_s = min(write_s, time.perf_counter() - t0)
                t0 = time.perf_counter()
                f.read_into(buf, 0).wait()
                read_s = min(read_s, time.perf_counter() - t0)
        finally:
            f.close(unlink=False)
    finally:
        os.unlink(path)
    return buf.numel() / write_s, buf.numel() / read_s


def parse_mib(text: str) -> int:
    """'256MiB', '16MiB', '1GiB' -> bytes (at least 1 MiB)."""
    m = re.fullmatch(r"(\d+)\s*(MiB|GiB)", text.strip())
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 256MiB or 1GiB")
    return int(m.group(1)) * (MIB if m.group(2) == "MiB" else 1024 * MIB)


def meminfo(key: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def process_baseline() -> int:
    """What a training process holds in host memory before its model: RssAnon once the
    trainer's modules are imported and, on CUDA, its context made (measured before any
    measurement here, as bench/host_memory.py measures a rank)."""
    import megatron.training.training  # noqa: F401 - what a training process imports
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context
    return memory_status()["anon"]


def measured_dtype(run: RunConfig, on_cuda: bool) -> torch.dtype:
    """The run's working dtype; on CUDA 16-bit always (bf16 unless --fp16)."""
    if run.precision.dtype == "fp16":
        return torch.float16
    return torch.bfloat16 if (run.precision.dtype == "bf16" or on_cuda) else torch.float32


def profile(args: argparse.Namespace, run: RunConfig, baseline: int) -> HardwareProfile:
    started = time.perf_counter()
    device = get_device()
    on_cuda = device.kind == "cuda"
    gpus = args.gpus_per_node or (torch.cuda.device_count() if on_cuda else 2)
    model = run.model
    dtype = measured_dtype(run, on_cuda)
    copy_bytes = (256 if on_cuda else 64) * MIB

    h2d, d2h, h2d_shm = copy_rates(device, copy_bytes)
    progress(f"host -> device {h2d / 1e9:.1f} GB/s pinned, {h2d_shm / 1e9:.1f} GB/s from "
             f"/dev/shm; device -> host {d2h / 1e9:.1f} GB/s")
    cores = len(usable_cores())
    threads = max(1, cores // gpus)
    per_process = adam_rate(threads, 4 * MIB)
    progress(f"C++ AdamW {per_process / 1e9:.2f} G parameters/s per process at {threads} "
             f"threads; x {gpus} processes per node")
    host_bw = memory_bandwidth(copy_bytes)
    progress(f"host memory {host_bw / 1e9:.1f} GB/s (read + write)")
    device_adam = device_update_rate(device, 4 * MIB, repeats=3)
    downscale = downscale_rate(4 * MIB, repeats=3)
    progress(f"AdamW on the device {device_adam / 1e9:.2f} G parameters/s (fp32, torch ops); "
             f"fp32 -> bf16 on the host {downscale / 1e9:.2f} G parameters/s")
    # the device subgroups' mechanism, measured as --optimizer-gpu-stride auto measures it
    mechanism = measure_mechanism(
        device, CPUAdamW([torch.zeros(CALIBRATION_NUMEL)], threads=threads), CALIBRATION_NUMEL)
    progress(f"optimizer subgroups through the device {mechanism.params_per_s / 1e9:.3g} G "
             f"parameters/s, {mechanism.overhead_s * 1e6:.0f} us each, overlapping the C++ "
             f"AdamW {mechanism.overlap:.2f}")
    micro_batch = run.training.micro_batch_size
    tokens = model.seq_length * micro_batch
    matmul = matmul_flops(device, model.hidden_size, model.ffn_hidden_size, tokens, dtype)
    progress(f"matmul {model.hidden_size}x{model.ffn_hidden_size} ({str(dtype)[6:]}) at "
             f"{tokens} tokens: {matmul / 1e9:.1f} GFLOP/s")
    # the run's micro-batch, one sequence and twice the run's: the curve around the run
    batches = tuple(sorted({1, micro_batch, 2 * micro_batch}))
    # the processes training runs on this node, each playing one GPU (on CUDA one per GPU)
    processes = gpus if not on_cuda else min(gpus, torch.cuda.device_count())
    measured = pair_measurements(processes, args.model_flags, model, dtype, batches,
                                 args.rounds, micro_batch)
    rates, passes, latency = measured.rates, measured.passes, measured.latency_s
    per_instruction = measured.instruction_s
    peak, half = fit_efficiency_curve({b * model.seq_length: statistics.median(r)
                                       for b, r in rates.items()})
    compute_spread = max(spread(r) for r in rates.values())
    progress(f"{model.name} decoder layer forward ({model.hidden_size} hidden, "
             f"{model.seq_length} tokens a sequence), GFLOP/s by micro-batch, medians of "
             f"{args.rounds} rounds: "
             + ", ".join(f"{statistics.median(r) / 1e9:.1f} at {b} (spread {spread(r):.1%})"
                         for b, r in rates.items())
             + f": peak {peak / 1e9:.1f}, half of it at {half:.0f} tokens")
    # A BACKWARD is its recompute (one forward) and the backward proper: their ratio. The
    # curve and the one-layer stage's FORWARD time the same layer at the run's micro-batch;
    # the FORWARD (as the executor times it, more passes, alternating with the BACKWARD)
    # sets the curve's level there, the curve its shape across micro-batches. Taking their
    # difference as a per-pass overhead instead made the noise between two samples of one
    # quantity a cost of every pass (never below 0: the prediction only ever rose with it).
    forward_s, backward_s = passes["layer"]
    backward_ratio = backward_over_forward(forward_s, backward_s)
    tokens_mb = micro_batch * model.seq_length
    compute = (layer_forward_flops_per_token(model, model.seq_length) * tokens_mb
               * (tokens_mb + half) / (peak * tokens_mb))
    peak = peak_at_forward(model, micro_batch, half, 1.0, forward_s)
    progress(f"a one-layer stage at micro-batch {micro_batch} ({processes} process(es) at "
             f"once): FORWARD {forward_s * 1e3:.2f} ms (the curve: {compute * 1e3:.2f} ms; its "
             f"peak set to {peak / 1e9:.1f} GFLOP/s by the FORWARD), BACKWARD "
             f"{backward_s * 1e3:.2f} ms with its recompute: backward {backward_ratio:.2f} x "
             "forward")
    head_rate, head_backward = head_over_layer(model, passes["layer"], passes["head"])
    progress(f"a head stage (final norm, output layer to {model.planned_vocab_size} words, "
             f"loss) at micro-batch {micro_batch}: FORWARD {passes['head'][0] * 1e3:.2f} ms, "
             f"its flops at {head_rate:.2f} x the layer's rate; BACKWARD "
             f"{passes['head'][1] * 1e3:.2f} ms with its recompute: backward "
             f"{head_backward:.2f} x forward")
    embedding_s = sum(passes["embedding"])
    progress(f"an embedding stage's FORWARD + BACKWARD {embedding_s * 1e3:.2f} ms, "
             f"{embedding_s / (forward_s + backward_s):.1%} of the one-layer stage's (not "
             "priced: a table lookup)")
    progress(f"the executor's host time per instruction {per_instruction * 1e6:.0f} us (a "
             f"one-process pipeline of {PROGRAM_STAGES} one-layer stages, beyond compute, "
             f"{processes} process(es) at once); a one-layer stage's FORWARD and BACKWARD there "
             f"{measured.executor_compute_over_pass:.3f} x the stage's alone")
    if processes > 1:
        progress(f"point-to-point latency {latency * 1e6:.0f} us (half a one-element round "
                 f"trip, {'nccl' if on_cuda else 'gloo'})")
    if on_cuda and torch.cuda.device_count() > 1:
        p2p = gpu_p2p_rate(copy_bytes)
        progress(f"GPU 0 -> GPU 1 {p2p / 1e9:.1f} GB/s")
    else:
        p2p = loopback_rate(copy_bytes)
        progress(f"loopback socket (gloo between CPU ranks) {p2p / 1e9:.1f} GB/s")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY else soft
    host_total, shm_free = meminfo("MemTotal"), free_bytes(DEFAULT_SHM_DIR)
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if on_cuda else 0
    progress(f"host memory {host_total / 2**30:.1f} GiB, /dev/shm free {shm_free / 2**30:.1f} "
             f"GiB, ulimit -l {'unlimited' if memlock is None else memlock}"
             + (f", GPU memory {gpu_memory / 2**30:.1f} GiB" if on_cuda else ""))
    nvme_read = nvme_write = 0.0
    nvme_capacity = 0
    nvme_source = ""
    if args.nvme_path:
        nvme_write, nvme_read = nvme_rates(args.nvme_path, args.nvme_bytes)
        nvme_capacity = disk_free_bytes(args.nvme_path)
        progress(f"NVMe {args.nvme_path}: O_DIRECT write {nvme_write / 1e9:.2f} GB/s, read "
                 f"{nvme_read / 1e9:.2f} GB/s ({args.nvme_bytes // MIB} MiB), "
                 f"{nvme_capacity / 2**30:.1f} GiB free")
        nvme_source = (f"; NVMe: one drive, {args.nvme_path}, O_DIRECT sequential write "
                       f"(with fdatasync) then read of {args.nvme_bytes // MIB} MiB through "
                       "the state-file engine, capacity the free bytes of its file system")
    name = args.name or f"{platform.node()}-{device.kind}"
    what = (torch.cuda.get_device_name(0) if on_cuda else f"CPU device layer on {platform.processor() or platform.machine()}")
    profile = HardwareProfile(
        name=name,
        description=f"{gpus} x {what}, {cores} usable cores, measured by tools/profile_hardware.py",
        gpu_peak_flops=peak,
        gpu_max_efficiency=1.0,
        efficiency_half_tokens=int(half),
        pcie_bytes_per_s=h2d,
        p2p_bytes_per_s=p2p,
        cpu_optimizer_params_per_s=per_process * gpus,
        gpus_per_node=gpus,
        gpu_memory_bytes=gpu_memory,
        gpu_reserved_bytes=(torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0])
        if on_cuda else 0,
        d2h_bytes_per_s=d2h,
        h2d_shm_bytes_per_s=h2d_shm,
        host_memory_bytes_per_s=host_bw,
        gpu_update_params_per_s=device_adam,
        downscale_params_per_s=downscale,
        device_subgroup_params_per_s=mechanism.params_per_s,
        subgroup_overhead_s=mechanism.overhead_s,
        update_overlap=mechanism.overlap,
        cpu_cores=cores,
        host_memory_bytes=host_total,
        shm_bytes=shm_free,
        memlock_bytes=memlock,
        process_baseline_bytes=baseline,
        nvme_read_bytes_per_s=nvme_read,
        nvme_write_bytes_per_s=nvme_write,
        nvme_capacity_bytes=nvme_capacity,
        pass_overhead_s=0.0,  # in the FORWARD's level (see above)
        backward_over_forward=backward_ratio,
        head_rate_over_layer=head_rate,
        head_backward_over_forward=head_backward,
        p2p_latency_s=latency,
        instruction_overhead_s=per_instruction,
        executor_compute_over_pass=measured.executor_compute_over_pass,
        device_kind=device.kind,
        # a GPU's datasheet peak from the table of GPUs; None (the CPU, an unknown GPU):
        # --plan's MFU is then against the measured `peak`
        datasheet_peak_flops=(datasheet_peak_flops(what, "fp16" if dtype == torch.float16
                                                   else "bf16") if on_cuda else None),
        compute_shape={**layer_shape(model), "micro_batch_sizes": list(batches),
                       "dtype": str(dtype).removeprefix("torch."),
                       "vocab_size": model.planned_vocab_size},
        compute_spread=compute_spread,
        source=f"measured on {time.strftime('%Y-%m-%d')} in "
               f"{time.perf_counter() - started:.0f} s (compute: a decoder layer of the model "
               f"({model.name}) at micro-batches {', '.join(map(str, batches))}, {args.rounds} "
               "rounds; the C++ AdamW rate is one process's times the GPUs per node, which "
               "assumes they do not contend for memory bandwidth; the layer's throughput, "
               f"a pass's time, the latency and the executor's one-process pipeline "
               f"(its host time per instruction; its FORWARD/BACKWARD instructions' compute "
               f"over the same stages' passes alone, which scales every priced pass) "
               f"measured by {processes} process(es) at once)"
               + nvme_source,
    )
    device.close()
    return profile


def planned_flags(model_flags: list[str]) -> list[str]:
    """pretrain_llama.py's flags of the run whose model the compute is measured at: the
    small preset when they name no model."""
    names = {"--model-preset", *(f"--{field.replace('_', '-')}" for field in MODEL_FIELDS)}
    if not any(flag.split("=")[0] in names for flag in model_flags):
        return ["--model-preset", "small", *model_flags]
    return model_flags


def planned_run(model_flags: list[str]) -> RunConfig:
    """The run of `planned_flags`, parsed as training parses them (a bad one exits 2 in
    one line)."""
    return parse_args(planned_flags(model_flags))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Any other flag is pretrain_llama.py's and describes the planned run: "
               "--model-preset NAME or the sizes (--num-layers --hidden-size ...), "
               "--seq-length, --micro-batch-size, --bf16/--fp16, --attention-backend "
               "(default: the small preset)")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the profile here (default: print it)")
    parser.add_argument("--name", default=None, help="the profile's name (default: host-device)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="processes (GPUs) per node training would run (default: the GPUs "
                             "visible, or 2 on the CPU device layer)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the layer's compute measurement (default 3); the "
                             "profile keeps their spread")
    parser.add_argument("--nvme-path", default=None, metavar="DIR",
                        help="measure the drive for optimizer states on NVMe: a temporary "
                             "file in DIR (removed after); default: the NVMe fields stay 0")
    parser.add_argument("--nvme-bytes", type=parse_mib, default=256 * MIB, metavar="SIZE",
                        help="the temporary file's size (default 256MiB)")
    args, model_flags = parser.parse_known_args(argv)
    args.model_flags = planned_flags(model_flags)
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        parser.exit(2, f"{parser.prog}: error: --nvme-path {args.nvme_path}: not a directory\n")
    if args.nvme_path is not None and (filesystem_of(args.nvme_path) in ("tmpfs", "ramfs")
                                       or not direct_io_supported(args.nvme_path)):
        # tmpfs takes O_DIRECT on recent kernels, but it is memory, not a drive
        parser.exit(2, f"{parser.prog}: error: --nvme-path {args.nvme_path}: on "
                       f"{filesystem_of(args.nvme_path)}, not a drive that takes O_DIRECT; "
                       "choose a directory on the drive\n")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        parser.exit(2, f"{parser.prog}: error: --gpus-per-node {args.gpus_per_node}: "
                       "expected a positive integer\n")
    if args.rounds < 1:
        parser.exit(2, f"{parser.prog}: error: --rounds {args.rounds}: expected a positive "
                       "integer\n")
    if args.out:  # before a minute of measurements, not after
        try:
            check_writable_file("--out", args.out)
        except ConfigError as exc:
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
    run = planned_run(model_flags)
    baseline = process_baseline()
    initialize_distributed()  # megatron-core's layers need its (one-process) groups
    try:
        text = profile(args, run, baseline).to_json()
    finally:
        shutdown_distributed()
    if args.out:
        make_parent_dir(args.out)
        atomic_write(args.out, lambda stream: stream.write(text.encode()))
        progress(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
