"""The parameter store across real processes: four local ranks, and two simulated nodes.

Children are forked (not spawned): a spawned child re-imports torch, which costs seconds
each on a 2-core machine; everything the workers use is imported here, before the fork.
"""

import multiprocessing as mp
import os
import uuid

import torch
import torch.distributed as dist

from megatron.common.ports import reserved_port
from megatron.offload.device import get_device
from megatron.offload.multinode import push_parameters, receive_parameters
from megatron.offload.param_store import ParameterStore, job_segments
from megatron.offload.prefetch import ParamSlots

NUMEL = 1 << 20  # 2 MiB of bf16 per stage
STAGE = (2, 1)


def pattern(version: int, numel: int = NUMEL) -> torch.Tensor:
    """Distinct, exactly representable bf16 values for each version."""
    return ((torch.arange(numel) % 97) * (version + 1) - 50).to(torch.bfloat16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def local_rank_worker(rank: int, job_id: str, barrier, results) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    store = ParameterStore(job_id=job_id, rank=rank, procs_per_node=4)
    if rank == 0:  # the owner of backward stage STAGE
        segment = store.create(STAGE, NUMEL, torch.bfloat16)
        segment.write(pattern(1), version=1)
    else:
        segment = store.attach(STAGE, NUMEL, torch.bfloat16)
        segment.wait_version(1)
    view = segment.params
    first = same_bytes(view, pattern(1))
    barrier.wait()  # everybody has read version 1
    if rank == 0:  # the optimizer writes, then publishes
        segment.write(pattern(2), version=2)
    else:
        segment.wait_version(2)
    # the same tensor (a view of the mapping, never re-read) now holds version 2
    second = same_bytes(view, pattern(2)) and view.data_ptr() == segment.params.data_ptr()
    with get_device("cpu") as dev:  # the one copy: into the device double buffer
        buf = ParamSlots(dev, budget_bytes=4 * NUMEL, dtype=torch.bfloat16)
        slot = buf.prefetch(STAGE, segment.params)
        buf.wait_ready(slot)
        on_device = same_bytes(slot.params, pattern(2))
    barrier.wait()  # the owner removes the segment only after every reader is done
    store.close()
    results.put((rank, first, second, on_device))


def test_four_local_ranks_share_one_stage_through_shared_memory():
    job_id = f"test-{uuid.uuid4().hex}"
    ctx = mp.get_context("fork")  # no torch re-import per child
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=local_rank_worker, args=(r, job_id, barrier, results)) for r in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    outcome = sorted(results.get(timeout=5) for _ in range(4))
    assert outcome == [(r, True, True, True) for r in range(4)]
    assert job_segments(job_id) == []


def two_node_worker(rank: int, job_id: str, port: int, steps: int, results) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # one process per simulated node: rank 0 is node 0 (owner), rank 1 is node 1
    store = ParameterStore(job_id=job_id, rank=rank, procs_per_node=1)
    numel = 4096
    segment = store.create((0, 0), numel, torch.bfloat16)  # owner / node-1 replica
    seen = []
    for step in range(1, steps + 1):
        if rank == 0:
            segment.write(pattern(step, numel), version=step)  # the optimizer step
            push_parameters(segment, [1])
        else:
            version = receive_parameters(segment, src_rank=0)
            fresh = segment.wait_version(step) == step == version
            seen.append(fresh and same_bytes(segment.params, pattern(step, numel)))
    dist.barrier()
    results.put((rank, store.node, os.path.basename(segment.path), seen))
    store.close()
    dist.destroy_process_group()


def test_forward_stage_on_node_1_sees_each_update_of_its_owner_on_node_0():
    job_id = f"test-{uuid.uuid4().hex}"
    ctx = mp.get_context("fork")  # no torch re-import per child
    results = ctx.Queue()
    steps = 3
    with reserved_port() as port:  # rank 0's store binds it in its process
        procs = [
            ctx.Process(target=two_node_worker, args=(r, job_id, port, steps, results))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    (_, node0, name0, _), (_, node1, name1, seen) = sorted(results.get(timeout=5) for _ in range(2))
    assert (node0, node1) == (0, 1) and name0 != name1  # separate node namespaces
    assert seen == [True] * steps
    assert job_segments(job_id) == []


def _create_and_hang(job_id: str, shm_dir: str, pids) -> None:
    """A worker that creates two segments (starting its reaper) and waits to be killed."""
    from megatron.offload.reaper_client import REAPER
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    store = ParameterStore(job_id=job_id, rank=0, procs_per_node=1, shm_dir=shm_dir)
    for key in ((0, 0), (1, 0)):
        store.create(key, NUMEL, torch.bfloat16).write(pattern(0), version=0)
    pids.put((os.getpid(), REAPER._proc.pid))
    import time
    time.sleep(600)


def test_segments_of_workers_killed_with_their_reapers_are_swept_by_any_later_start(
        private_shm_dir):
    """SIGKILL to a worker and to its reaper leaves its segments; the next start, under
    another run id, removes them (the creator is dead) and says how much."""
    import signal
    dead_job = f"killed-{uuid.uuid4()}"
    ctx = mp.get_context("fork")
    pids = ctx.Queue()
    worker = ctx.Process(target=_create_and_hang, args=(dead_job, private_shm_dir, pids))
    worker.start()
    try:
        worker_pid, reaper_pid = pids.get(timeout=60)
        os.kill(reaper_pid, signal.SIGKILL)
        os.kill(worker_pid, signal.SIGKILL)
        worker.join(timeout=30)
        left = job_segments(dead_job, private_shm_dir)
        assert len(left) == 2  # nobody cleaned up: the case
        with ParameterStore(job_id=f"next-{uuid.uuid4()}", rank=0, procs_per_node=1,
                            shm_dir=private_shm_dir) as store:
            assert set(left) == set(store.swept)
            assert store.swept_bytes >= 2 * 2 * NUMEL
        assert job_segments(dead_job, private_shm_dir) == []
    finally:
        if worker.is_alive():
            worker.kill()
