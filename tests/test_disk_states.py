"""Optimizer states in a file (megatron/optimizer/disk_states.py) against the same
optimizer in host memory, with exact rollbacks and without (the arithmetic inverse), in
every precision: steps, rollbacks, clipping corrections and commits in the order a program
issues them give the same bits; host memory stays within
the window; the file is removed on close, by the reaper after a SIGKILL, and by the sweep
of the next start when its process is gone."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron.offload.reaper_client import REAPER
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.optimizer.disk_states import (
    DiskStates,
    file_bytes,
    state_file_name,
    sweep_stale,
    window_bytes,
)
from megatron.optimizer.state_io import round_up
from megatron.optimizer.subgroups import Subgroup

REPO = Path(__file__).resolve().parents[1]
SIZES = [1000, 37, 5000, 4096, 1]


def pair(tmp_path, master_dtype=torch.float32, state_dtype=torch.float32, window=2,
         exact=True, **disk_kwargs):
    torch.manual_seed(0)
    params = [torch.randn(n) for n in SIZES]
    disk = DiskStates(tmp_path, SIZES, master_dtype, state_dtype, window=window,
                      job="test", rank=0, tracker=REAPER, **disk_kwargs)
    kwargs = dict(lr=1e-2, weight_decay=0.1, threads=1, master_dtype=master_dtype,
                  state_dtype=state_dtype, exact_rollback=exact)
    return CPUAdamW(params, **kwargs), CPUAdamW(params, disk=disk, **kwargs), disk


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "inverse"])
@pytest.mark.parametrize("master,states", [(F32, F32), (F32, BF16), (BF16, BF16)],
                         ids=["fp32", "bf16-states", "bf16-all"])
def test_steps_rollbacks_and_corrections_equal_host_memory(tmp_path, master, states, exact):
    host, nvme, disk = pair(tmp_path, master, states, exact=exact)
    try:
        train_both(host, nvme)
        # a window of 2 and the scratch buffer, each the largest group's p, m, v padded
        largest = round_up(max(SIZES) * master.itemsize) + \
            2 * round_up(max(SIZES) * states.itemsize)
        assert nvme.host_state_bytes() == 3 * largest
        assert window_bytes(SIZES, master, states, 2) == 3 * largest
        if exact:  # host memory then holds snapshots too
            assert nvme.host_state_bytes() < host.host_state_bytes()
        assert os.path.getsize(disk.path) == file_bytes(SIZES, master, states)
    finally:
        disk.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "inverse"])
def test_the_scratch_holds_a_chunk_and_chunks_across_subgroups_equal_host_memory(tmp_path,
                                                                                  exact):
    """Rollbacks, corrections and the initial states go through the scratch buffer a chunk
    at a time (here 4096 elements: the 5000-element group in two, its middle subgroup cut
    by the chunk boundary, stochastic rounding by element position): the same bits as host
    memory, and the scratch holds a chunk, not the largest group."""
    host, nvme, disk = pair(tmp_path, BF16, BF16, exact=exact, chunk=4096)
    split = (Subgroup(0, 1000, False), Subgroup(1000, 4500, False), Subgroup(4500, 5000, False))
    for optimizer in (host, nvme):
        optimizer.set_subgroups(2, split)
    try:
        train_both(host, nvme)
        assert nvme.host_state_bytes() == 2 * 3 * round_up(max(SIZES) * 2) + 3 * 4096 * 2
    finally:
        disk.close()
    with pytest.raises(ValueError, match="multiple of 4096"):
        DiskStates(tmp_path, SIZES, F32, F32, window=1, job="test", rank=0, tracker=REAPER,
                   chunk=1000)
    assert os.listdir(tmp_path) == []


def train_both(host: CPUAdamW, nvme: CPUAdamW) -> None:
    """Seven iterations in the order a program issues them (an overflow at 1 and 4, a
    clip correction at 2 and 5) on both; states, working copies and steps equal."""
    outs = {o: [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES] for o in ("host", "nvme")}
    for iteration in range(7):
        grads = [torch.randn(n) for n in SIZES]
        if iteration == 4:
            grads[2][17] = float("inf")  # its own step leaves it; the verdict rolls back
        for g in range(len(SIZES)):
            host.step_group(g, grads[g], out=outs["host"][g], clip=0.8)
            nvme.storage.request_read(g)
            nvme.step_group(g, grads[g], out=outs["nvme"][g], clip=0.8)
            nvme.storage.request_write(g)
        for g in range(len(SIZES)):
            if iteration in (1, 4) and host.has_update(g):  # an overflow elsewhere
                host.rollback_group(g)
                nvme.storage.reserve(g)
                nvme.rollback_group(g)
                nvme.storage.release(g)
            elif iteration in (2, 5):  # the true clip factor differs
                host.correct_group(g, 0.5)
                nvme.storage.reserve(g)
                nvme.correct_group(g, 0.5)
                nvme.storage.release(g)
            host.commit_group(g)
            nvme.commit_group(g)
    for g in range(len(SIZES)):
        for want, got in zip(host.states(g), nvme.states(g)):
            assert torch.equal(want, got), g
        assert torch.equal(outs["host"][g], outs["nvme"][g]), g
        assert host.step_count(g) == nvme.step_count(g)


def test_a_read_waits_for_a_window_buffer_and_never_exceeds_the_window(tmp_path):
    """Every read and write asked for before any step (the program runs ahead of the
    optimizer threads): one buffer serves them in turn, and a read waits only for the
    writes asked for before it, not for its own stage's."""
    host, nvme, disk = pair(tmp_path, window=1)
    try:
        grads = [torch.randn(n) for n in SIZES]
        for g in range(len(SIZES)):
            nvme.storage.request_read(g)
        for g in range(len(SIZES)):
            nvme.storage.request_write(g)

        def steps() -> None:
            for g in range(len(SIZES)):
                nvme.step_group(g, grads[g])
        stepper = threading.Thread(target=steps, daemon=True)
        stepper.start()
        stepper.join(timeout=60)
        assert not stepper.is_alive(), "the reads and writes wait on each other"
        for g in range(len(SIZES)):
            host.step_group(g, grads[g])
        for g in range(len(SIZES)):
            nvme.commit_group(g)
            host.commit_group(g)
        assert all(torch.equal(a, b) for g in range(len(SIZES))
                   for a, b in zip(host.states(g), nvme.states(g)))
        assert disk._free[0].qsize() == 1
    finally:
        disk.close()


def test_checkpoint_state_round_trips_through_the_file(tmp_path):
    host, nvme, disk = pair(tmp_path)
    try:
        state = host.state_dict()
        for group in state["groups"]:
            group["master"] = group["master"] * 2
            group["step"] = 7
        nvme.load_state_dict(state)
        for g in range(len(SIZES)):
            assert torch.equal(nvme.master(g), state["groups"][g]["master"])
            assert nvme.step_count(g) == 7
    finally:
        disk.close()


_HOLDER = """
import sys, time, torch
from megatron.offload.reaper_client import REAPER
from megatron.optimizer.disk_states import DiskStates
disk = DiskStates(sys.argv[1], [1 << 16], torch.float32, torch.float32, 1, "killed", 0,
                  tracker=REAPER)
print(disk.path, flush=True)
time.sleep(600)
"""


def test_sigkill_leaves_no_state_file(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    path = holder.stdout.readline().strip()
    assert os.path.exists(path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path)


def test_the_next_start_sweeps_files_of_dead_processes_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / state_file_name("old", 0, int(dead))
    live = tmp_path / state_file_name("running", 1)  # this process: alive
    other = tmp_path / "megatron-otherhost.job.rank0.pid1.optstate"
    unrelated = tmp_path / "notes.txt"
    for path in (stale, live, other, unrelated):
        path.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (live, other, unrelated))


def test_close_after_a_failed_iteration_does_not_wait_for_steps_that_never_run(tmp_path):
    """Reads and writes asked for, the window full, no step ever runs (the iteration
    failed): close() wakes the threads and removes the file."""
    _, nvme, disk = pair(tmp_path, window=1)
    for g in range(len(SIZES)):
        nvme.storage.request_read(g)
        nvme.storage.request_write(g)
    closer = threading.Thread(target=disk.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert os.listdir(tmp_path) == []


def test_the_next_iterations_read_may_be_asked_for_while_the_write_is_still_queued(tmp_path):
    """The program runs ahead of the writer thread: iteration 2's reads are asked for while
    iteration 1's writes wait behind another write. They read what iteration 1 wrote and
    committed."""
    host, nvme, disk = pair(tmp_path, window=len(SIZES))
    gate = threading.Event()
    disk._writes.put(gate.wait)  # the writer is busy with something slow
    try:
        for iteration in range(2):
            grads = [torch.randn(n) for n in SIZES]
            for g in range(len(SIZES)):
                nvme.storage.request_read(g)
            gate.set() if iteration == 1 else None
            for g in range(len(SIZES)):
                host.step_group(g, grads[g])
                nvme.step_group(g, grads[g])
                nvme.storage.request_write(g)
            for g in range(len(SIZES)):
                host.commit_group(g)
                nvme.commit_group(g)
        for g in range(len(SIZES)):
            for want, got in zip(host.states(g), nvme.states(g)):
                assert torch.equal(want, got), g
    finally:
        gate.set()
        disk.close()


def test_a_failed_write_is_one_line_naming_the_file_at_the_next_request(tmp_path):
    """The drive refuses a write (here: ENOSPC injected): the writer thread keeps the error
    and the program's next request raises it, one line naming the file and the cause."""
    import errno

    from megatron.optimizer.disk_states import DiskStateError

    _, nvme, disk = pair(tmp_path)

    def full(buffer, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), disk.path)
    disk._file.write_from = full
    try:
        nvme.storage.request_read(0)
        nvme.step_group(0, torch.randn(SIZES[0]))
        nvme.storage.request_write(0)
        nvme.commit_group(0)
        disk.wait_written(0)
        with pytest.raises(DiskStateError) as failed:
            nvme.storage.request_read(0)
        message = str(failed.value)
        assert "\n" not in message and disk.path in message
        assert "No space left on device" in message
    finally:
        disk.close()
