"""The process's own limits, checked before anything is allocated: `ulimit -n` against the
descriptors the run opens, `ulimit -v` against the address space its threads reserve.

Both fail late and far from their cause otherwise: gloo's 'Too many open files' while
the process groups connect, 'can't start new thread' in the first iteration (each thread
reserves a stack and, up to 8 per core, a 64 MiB malloc arena of address space, which
ulimit -v counts although no memory is used). A soft descriptor limit below the hard one
is raised to it first, as a shell user would (the hard limit is what was meant as a
ceiling); what still does not fit is one line naming the limit, exit status 2.
"""

from __future__ import annotations

import os
import resource

from megatron.common.units import format_bytes
from megatron.common.workers import cores_per_rank
from megatron.config.run import RunConfig
from megatron.planning.fit import ResourceError

MALLOC_ARENA_BYTES = 64 * 2**20  # glibc's HEAP_MAX_SIZE on 64-bit hosts
DEFAULT_STACK_BYTES = 8 * 2**20
# Threads besides the optimizer's kernel threads: state I/O (4) and its reader and writer,
# the optimizer's task runner, prefetch and offload workers, gloo's, the checkpoint
# writer, the launcher watch, and the interpreter's own.
OTHER_THREADS = 24
# Descriptors besides the peers': the interpreter's and torch's libraries, the state file,
# shared-memory segments while they are mapped, the reaper's pipe, checkpoint files.
BASE_DESCRIPTORS = 128
# gloo: a connection per peer in each process group that reaches it (the world, the host
# group, the checkpoint writer's, the data-parallel and pipeline groups), plus the store.
DESCRIPTORS_PER_PEER = 8


def planned_threads(run: RunConfig) -> int:
    return (run.cpu_optimizer.cpu_optimizer_threads or cores_per_rank()) + OTHER_THREADS


def needed_descriptors(world_size: int) -> int:
    return BASE_DESCRIPTORS + DESCRIPTORS_PER_PEER * max(world_size - 1, 0)


def check_open_files(world_size: int) -> None:
    """`ulimit -n` fits the descriptors this rank opens (raising the soft limit to the hard
    one when that is needed and allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + needed_descriptors(world_size)
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft != resource.RLIM_INFINITY and soft < need:
        raise ResourceError("open files", f"ulimit -n {soft} is below the {need} descriptors "
                            f"this process needs with {world_size} processes; raise it "
                            f"(ulimit -n {need} or more)")


def _mapped_bytes() -> int:
    """The address space this process has mapped now (VmSize)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def thread_reservation(threads: int) -> int:
    """Address space `threads` new threads reserve: a stack each, and a malloc arena for
    each up to glibc's 8 per core."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = DEFAULT_STACK_BYTES if stack == resource.RLIM_INFINITY else stack
    cores = os.cpu_count() or 1
    return threads * stack + min(threads, 8 * cores) * MALLOC_ARENA_BYTES


def check_address_space(run: RunConfig, own_state_bytes: int) -> None:
    """`ulimit -v` leaves room for what is mapped now, this process's share of the
    optimizer states and the threads it will start (an estimate: activations and buffers
    come on top; the threads' arenas are reserved as each first allocates)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return
    threads = planned_threads(run)
    mapped, reserved = _mapped_bytes(), thread_reservation(threads)
    need = mapped + own_state_bytes + reserved
    if need > soft:
        raise ResourceError("address space", f"ulimit -v {soft // 1024} (KiB) is below what "
                            f"this process needs at least: {format_bytes(need)} ("
                            f"{format_bytes(mapped)} mapped now, {format_bytes(own_state_bytes)}"
                            f" of optimizer states, {format_bytes(reserved)} for the stacks "
                            f"and malloc arenas of its {threads} threads); raise it or "
                            "remove the limit (ulimit -v unlimited)")


def check_process_limits(run: RunConfig, world_size: int) -> None:
    """Both checks; the optimizer states are shared out over the pipeline's ranks."""
    check_open_files(world_size)
    params = run.model.parameters(run.vocab_size_given or 1).total
    share = params * run.precision.optimizer_bytes_per_param // max(
        world_size // run.data_parallel_size, 1)
    check_address_space(run, share)
