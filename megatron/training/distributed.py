"""Process start: the device decision applied, then the process groups and megatron-core.

Every process that builds a model starts here, on either device path:
1. the device decision (megatron/config/device_choice.py): CUDA or the CPU device layer,
   the GPU index, the backend, refusing more processes per node than GPUs (exit 2)
   before anything is allocated;
2. `torch.cuda.set_device` on CUDA, then the process group (torchrun's environment when
   present, a one-process group otherwise: megatron-core's layers read their groups from
   parallel_state even in one process) and megatron-core's model-parallel groups;
3. megatron-core's device-side setup, the same on both paths: its CUDA RNG tracker seeded
   from --seed as Megatron-LM does on a GPU (on the CPU, after standing a host generator
   in for CUDA's: megatron/models/cpu_adaptation.py).

Every collective and point-to-point wait, in every group, gives up after
--distributed-timeout-minutes (Megatron's, whole minutes). A rank that never joins, or
stops answering (hung, stopped, cut off), is then one line on each rank that waited for
it (PeerTimeout, exit status 1): which rank, what this one waited for, the timeout. Tests
stand a few seconds in for the minutes through MEGATRON_SYSX_TEST_TIMEOUT_S (a testing
aid, as MEGATRON_SYSX_TEST_FAIL is; never needed by a run).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.config.attention_kernel import cpu_layer_gpu
from megatron.config.device_choice import DeviceChoice, choose_device, cpu_device_capacity
from megatron.config.errors import ConfigError
from megatron.models.cpu_adaptation import set_up_megatron_core
from megatron.pipeline.data_parallel import ParallelLayout
from megatron.pipeline.host_group import forget_host_group, set_group_timeout
from megatron.pipeline.node_memory import memlock_limit

TEST_TIMEOUT_ENV = "MEGATRON_SYSX_TEST_TIMEOUT_S"


@dataclass(frozen=True)
class CollectiveTimeout:
    """How long any rank waits for another, and what set it (for the messages)."""

    seconds: float
    source: str

    def __str__(self) -> str:
        return f"{self.seconds:g} s ({self.source})"


def collective_timeout(minutes: int = 10) -> CollectiveTimeout:
    """--distributed-timeout-minutes (Megatron's default 10), or the seconds of
    MEGATRON_SYSX_TEST_TIMEOUT_S where a test sets it."""
    override = os.environ.get(TEST_TIMEOUT_ENV)
    if override:
        try:
            seconds = float(override)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise ConfigError(TEST_TIMEOUT_ENV, override, "expected seconds > 0 (a testing "
                              "aid: unset it to use --distributed-timeout-minutes)")
        return CollectiveTimeout(seconds, TEST_TIMEOUT_ENV)
    return CollectiveTimeout(60.0 * minutes, f"--distributed-timeout-minutes {minutes}")


class PeerTimeout(RuntimeError):
    """Another rank did not answer in time (it never joined, stopped or hung): a fault,
    exit status 1; the message is one line."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    data_parallel_size: int = 1
    device: DeviceChoice = DeviceChoice("cpu", 0, "gloo")

    @property
    def torch_device(self) -> torch.device:
        """Where this process's model, batches and collectives' tensors live."""
        return torch.device(self.device.torch_device)

    @property
    def pipeline_size(self) -> int:
        return self.world_size // self.data_parallel_size

    @property
    def layout(self) -> ParallelLayout:
        """This process's place in the pipeline x data-parallel world."""
        return ParallelLayout(self.pipeline_size, self.data_parallel_size, self.rank)

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank


def check_data_parallel_size(data_parallel_size: int, world_size: int) -> None:
    """world = pipeline size x data-parallel size (before anything is started)."""
    if data_parallel_size < 1 or world_size % data_parallel_size:
        raise ConfigError("--data-parallel-size", data_parallel_size,
                          f"expected a divisor of the number of processes ({world_size}): "
                          "world size = pipeline size x data-parallel size")


def decide_device(share_gpu: bool = False) -> DeviceChoice:
    """This process's device, from what the machine reports and torchrun's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = torch.cuda.is_available()
    choice = choose_device(available, torch.cuda.device_count() if available else 0,
                           local_rank, local_world, share_gpu)
    if choice.kind == "cpu":  # refused before any start: a bad
        cpu_device_capacity()  # MEGATRON_CPU_DEVICE_MEMORY
        cpu_layer_gpu()  # MEGATRON_CPU_DEVICE_GPU
        memlock_limit(choice.kind)  # MEGATRON_CPU_DEVICE_MEMLOCK (read again by a pipeline)
    return choice


def apply_device(choice: DeviceChoice, seed: int,
                 set_cuda_device: Callable[[int], None] | None = None) -> None:
    """The device-side setup the choice asks for, before the process group: the current
    CUDA device, then megatron-core's (the same on both paths; tensor and expert parallel
    ranks are 0, so it needs no process group). `set_cuda_device` stands in for
    `torch.cuda.set_device` in tests of the CUDA branch."""
    if choice.kind == "cuda":
        (set_cuda_device or torch.cuda.set_device)(choice.index)
    set_up_megatron_core(choice.kind, seed)


def process_group_options(choice: DeviceChoice) -> dict:
    """init_process_group's device binding. NCCL is bound to the rank's GPU, which creates
    the world communicator at once (eager): a batched point-to-point exchange on it is then
    never its first use, which torch requires every rank to join."""
    return {"device_id": torch.device(choice.torch_device)} if choice.backend == "nccl" else {}


def initialize_distributed(timeout: CollectiveTimeout | None = None,
                           data_parallel_size: int = 1, seed: int = 1234,
                           share_gpu: bool = False) -> DistInfo:
    """Idempotent. Uses torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) when set.
    megatron-core's parallel_state gets the real groups: pipeline size = world /
    `data_parallel_size` (tensor parallel 1). `timeout`: every group's (default
    collective_timeout()); `seed`: --seed (Megatron's default 1234); `share_gpu`:
    --share-gpu. PeerTimeout when the other ranks do not all join in time."""
    check_data_parallel_size(data_parallel_size, int(os.environ.get("WORLD_SIZE", "1")))
    timeout = timeout or collective_timeout()
    choice = decide_device(share_gpu)
    apply_device(choice, seed)  # before the process group: NCCL binds to the current GPU
    if not dist.is_initialized():
        set_group_timeout(timedelta(seconds=timeout.seconds))
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            try:
                dist.init_process_group(choice.backend,
                                        timeout=timedelta(seconds=timeout.seconds),
                                        **process_group_options(choice))
            except (dist.DistStoreError, dist.DistNetworkError) as exc:
                if "EADDRINUSE" in str(exc):  # rank 0 could not listen: bad input
                    raise ConfigError("environment variable MASTER_PORT",
                                      os.environ.get("MASTER_PORT"),
                                      "in use by another process on this node; expected a "
                                      "free port for rank 0's store") from None
                raise rendezvous_failure(exc, timeout) from None
        else:
            dist.init_process_group(choice.backend, store=dist.HashStore(), rank=0,
                                    world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=dist.get_world_size() // data_parallel_size)
    _check_layout(data_parallel_size)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        backend=dist.get_backend(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        device=choice,
    )


def shutdown_distributed() -> None:
    forget_host_group()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_layout(data_parallel_size: int) -> None:
    """The runtime's rank layout (megatron/pipeline/data_parallel.py) is megatron-core's."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    layout = ParallelLayout(dist.get_world_size() // data_parallel_size, data_parallel_size, rank)
    ours = (layout.pipeline_rank, layout.data_parallel_rank, data_parallel_size)
    found = (parallel_state.get_pipeline_model_parallel_rank(),
             parallel_state.get_data_parallel_rank(),
             parallel_state.get_data_parallel_world_size())
    if found != ours:
        raise RuntimeError(f"rank {rank}: megatron-core places it at (pipeline rank, "
                           f"data-parallel rank, data-parallel size) {found}, the runtime at "
                           f"{ours}")


# What gloo says when the process at the other end of a connection is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what caused it, and so on (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def peer_gone(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a connection to another rank that closed: that
    rank ended (killed, interrupted, failed), and said why itself."""
    return any(any(text in str(e) for text in _PEER_GONE) for e in causes(exc))


def rendezvous_failure(exc: BaseException, timeout: CollectiveTimeout) -> PeerTimeout:
    """The one line of a rendezvous that did not complete: rank 0 counted fewer ranks than
    WORLD_SIZE within the timeout (the store counts them, it does not name them: when only
    rank 0 came, the missing ones are all the others), or this rank could not reach rank
    0's store."""
    rank, world = os.environ.get("RANK", "?"), int(os.environ.get("WORLD_SIZE", "0"))
    store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        came = int(joined.group(1))
        missing = (_rank_range(1, world - 1) if came == 1 else
                   f"{world - came} of {_rank_range(1, world - 1)} (the store counts the "
                   "ranks that came, it does not name them)")
        return PeerTimeout(f"rank {rank}: only {came} of {world} ranks (WORLD_SIZE) joined "
                           f"within {timeout}; missing: {missing}: start every rank, with "
                           f"MASTER_ADDR:MASTER_PORT {store} reachable from its node")
    if "timed out" in text.lower():
        return PeerTimeout(f"rank {rank}: rank 0 did not answer within {timeout}: its store "
                           f"at {store} (MASTER_ADDR:MASTER_PORT) cannot be reached; start "
                           "rank 0, or give the address of its node")
    return PeerTimeout(f"rank {rank}: the rendezvous at {store} (MASTER_ADDR:MASTER_PORT) "
                       f"failed: {text}")


def _rank_range(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


# What gloo says when a wait for another rank ran out of time.
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")


def timed_out(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is gloo saying that a wait for another rank ran
    past the collective timeout."""
    return any(_TIMED_OUT.search(str(e)) for e in causes(exc))
