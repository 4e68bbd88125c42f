"""The CPU optimizer's kernel threads are one persistent pool: steps start no thread,
optimizers share it, concurrent steps on it stay exact, and closing it leaves no thread."""

import os
import threading

import pytest
import torch

from megatron.optimizer import CPUAdamW
from megatron.optimizer.worker_pool import WorkerPool, shared_pool


def os_threads() -> set[str]:
    """Threads of this process as the kernel sees them (C++ threads included), by id: other
    threads of the test process may end meanwhile, so counts are compared as sets."""
    return set(os.listdir("/proc/self/task"))


def grads(seed: int, n: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(count)]


N = 200_000  # several kernel blocks, so every worker takes some


def test_steps_start_no_thread_and_optimizers_share_one_pool():
    a = CPUAdamW([torch.zeros(N), torch.zeros(N)], threads=2)
    b = CPUAdamW([torch.zeros(N)], threads=2)
    assert a._pool is b._pool is shared_pool(2)
    assert a._pool.worker_count == 2
    before = os_threads()
    for g in grads(0, N, 10):
        a.step_group(0, g)
        a.step_group(1, g)
        b.step_group(0, g)
    assert os_threads() == before


def test_concurrent_steps_on_one_pool_match_one_at_a_time():
    steps = grads(1, N, 4)
    alone = CPUAdamW([torch.zeros(N) for _ in range(3)], threads=2)
    for g in steps:
        for group in range(3):
            alone.step_group(group, g)
    shared = CPUAdamW([torch.zeros(N) for _ in range(3)], threads=2)

    def run(group: int) -> None:
        for g in steps:
            shared.step_group(group, g)

    workers = [threading.Thread(target=run, args=(group,)) for group in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for group in range(3):
        assert torch.equal(shared.master(group), alone.master(group))
        assert torch.equal(shared.exp_avg_sq(group), alone.exp_avg_sq(group))


def test_close_joins_every_worker_and_refuses_later_steps():
    before = os_threads()
    pool = WorkerPool(threads=3, cores=[])
    started = os_threads() - before
    assert len(started) == 3
    pool.close()
    pool.close()  # idempotent
    assert not started & os_threads()


def test_one_unpinned_thread_runs_in_the_caller():
    assert shared_pool(1).worker_count == 0


def test_a_refused_pinning_names_the_core_and_leaves_no_thread():
    before = os_threads()
    with pytest.raises(RuntimeError, match="cannot pin an optimizer thread to core 100000"):
        WorkerPool(threads=2, cores=[100_000])
    assert not os_threads() - before
