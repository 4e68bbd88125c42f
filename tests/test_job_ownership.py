"""A job's processes never outlive its launcher, and one --save directory belongs to one
job at a time: a second job is refused in one line naming the holder, the lock of a dead
job is taken over, a refused job removes nothing of the holder's, and a directory removed
during the run is locked again before the next save. A rank whose peer is gone, never
came or stopped answering says so in one line."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.common.save_lock import LOCK_NAME, LockError, SaveLock
from megatron.config.errors import ConfigError
from megatron.training.distributed import peer_gone
from megatron.training.save_lock import (
    SaveDirectoryLost,
    hold_save_directory,
    keep_save_directory,
)

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]

# A launcher (torchrun's agent, in miniature) that starts one worker and waits forever;
# the worker starts the watch, says so, and would sleep for a minute.
WORKER = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
          "from megatron.common.launcher_watch import watch_launcher; "
          "assert watch_launcher(0.05, rank=3); print('watching', flush=True); time.sleep(60)")
LAUNCHER = ("import subprocess, sys, time; "
            "w = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
            "print(w.pid, flush=True); time.sleep(60)")


def test_a_worker_stops_within_a_second_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(REPO)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "watching"  # the worker's, inherited
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while _alive(worker) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert not _alive(worker), "the worker outlived its launcher"
        assert time.monotonic() - t0 < 1.5
        stderr = launcher.stderr.read()
        assert stderr.strip().splitlines() == [
            f"pretrain_llama.py: error: rank 3: its launcher (pid {launcher.pid}) died; "
            "stopping"]
    finally:
        launcher.kill()
        launcher.wait()


def _alive(pid: int) -> bool:
    """Running (a zombie is not: the worker is no child of ours, init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


HOLDER = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
          "from megatron.common.save_lock import SaveLock; "
          "SaveLock(sys.argv[2]).acquire(); print('held', flush=True); time.sleep(60)")


def test_a_second_job_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken(tmp_path):
    save = tmp_path / "ckpt"
    staging = save / "iter_0000070.tmp"  # the holder's save in progress
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO), str(save)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_JOB_ID": "4242"})
    try:
        assert holder.stdout.readline().strip() == "held"
        staging.mkdir()
        with pytest.raises(ConfigError) as refused:
            hold_save_directory(str(save), rank=0, world_size=1)
        line = str(refused.value)
        assert "\n" not in line
        assert line.startswith(f"--save {save}: in use by another running job (job 4242, "
                               f"pid {holder.pid} on ")
        assert staging.is_dir()  # nothing of the holder's removed
        holder.kill()  # as an OOM killer would: its lock goes with it
        holder.wait()
        said = []
        lock = hold_save_directory(str(save), rank=0, world_size=1, log=said.append)
        assert said == [f"--save {save}: taking over the lock of a job that is gone "
                        f"(job 4242, pid {holder.pid} on {os.uname().nodename}, started "
                        + said[0].split("started ")[1]]
        with pytest.raises(LockError):  # now ours: a third one is refused
            SaveLock(str(save)).acquire()
        lock.release()
        assert not (save / LOCK_NAME).exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_or_finished_job_leaves_no_directory_it_created(tmp_path):
    save = tmp_path / "new" / "ckpt"
    lock = SaveLock(str(save))
    assert lock.acquire() is None
    assert (save / LOCK_NAME).exists()
    lock.release()
    assert os.listdir(tmp_path) == []  # "new" too


def test_a_rank_tells_a_gone_peer_from_its_own_fault():
    """A rank whose peer ended (Ctrl-C to that one process, a kill) meets gloo's closed
    connection inside an instruction: one line, not its traceback; its own faults are not
    mistaken for that."""
    from megatron.pipeline.executor import InstructionError

    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:42927. This is typically caused by a remote worker "
                          "crashing.")
    try:
        try:
            raise closed
        except RuntimeError as cause:
            raise RuntimeError("rank 1: instruction 2 (RECV_ACT) failed") from cause
    except RuntimeError as wrapped:
        assert peer_gone(wrapped)
    assert not peer_gone(RuntimeError("rank 1: instruction 3 failed: injected"))
    assert issubclass(InstructionError, RuntimeError)


def test_a_save_directory_removed_mid_run_is_locked_again_or_the_run_stops(tmp_path):
    """The --save directory is removed while the job runs: before its next save the job
    takes the recreated directory's lock again and says so; when another job took the
    directory meanwhile, it stops in one line (exit 1) and leaves that job's lock alone."""
    save = tmp_path / "ckpt"
    lock = hold_save_directory(str(save), rank=0, world_size=1)
    shutil.rmtree(save)
    said = []
    keep_save_directory(lock, str(save), 0, 1, said.append)
    assert said == [f"--save {save}: the directory (or its lock) was removed during the run; "
                    "recreated it and took its lock again (the checkpoints saved before went "
                    "with it)"]
    with pytest.raises(LockError):  # ours again: a second job is refused
        SaveLock(str(save)).acquire()
    keep_save_directory(lock, str(save), 0, 1, said.append)  # still held: nothing to say
    assert len(said) == 1

    shutil.rmtree(save)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO), str(save)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SaveDirectoryLost) as lost:
            keep_save_directory(lock, str(save), 0, 1, said.append)
        lock.release()
        assert (save / LOCK_NAME).exists()  # the other job's lock file stays
    finally:
        holder.kill()
        holder.wait()
    line = str(lost.value)
    assert "\n" not in line and len(said) == 1
    assert line.startswith(f"--save {save}: the directory was removed during the run and "
                           f"cannot be locked again: in use by another running job (pid "
                           f"{holder.pid} on ")
    assert line.endswith("stopping without saving (the checkpoints saved before went with "
                         "the directory)")


def test_a_wait_past_the_timeout_is_told_from_other_faults_and_from_a_gone_peer():
    """gloo's timeout, wrapped by the instruction that waited, is a timeout (the training
    loop turns it into one line); a closed connection is not, nor is a rank's own fault."""
    from megatron.training.distributed import timed_out

    waited = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                          "Timed out waiting 60000ms for recv operation to complete")
    try:
        try:
            raise waited
        except RuntimeError as cause:
            raise RuntimeError("rank 0: instruction 12 (RECV_ACT) failed") from cause
    except RuntimeError as wrapped:
        assert timed_out(wrapped) and not peer_gone(wrapped)
    assert not timed_out(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by "
                                      "peer [127.0.0.1]:42927"))
    assert not timed_out(RuntimeError("rank 1: instruction 3 failed: injected"))
    # outside an instruction (a collective of the loop), without --save
    from megatron.training.arguments import parse_args
    from megatron.training.timeouts import waited_too_long

    run = parse_args(["--model-preset", "tiny", "--load", "/ckpt"])
    assert str(waited_too_long(run, 1, 5, waited)) == (
        "rank 1: another rank did not answer within 600 s (--distributed-timeout-minutes 10) "
        "while rank 1 waited at a collective of iteration 5: it stopped, hung or cannot be "
        "reached; no --save: nothing of this run is saved (it started from --load /ckpt, "
        "unchanged)")


@pytest.mark.parametrize("error,line", [
    (("DistStoreError", "Timed out after 61 seconds waiting for clients. 1/4 clients joined."),
     "rank 0: only 1 of 4 ranks (WORLD_SIZE) joined within 60 s (--distributed-timeout-minutes "
     "1); missing: ranks 1-3: start every rank, with MASTER_ADDR:MASTER_PORT node0:6000 "
     "reachable from its node"),
    (("DistStoreError", "Timed out after 61 seconds waiting for clients. 3/4 clients joined."),
     "rank 0: only 3 of 4 ranks (WORLD_SIZE) joined within 60 s (--distributed-timeout-minutes "
     "1); missing: 1 of ranks 1-3 (the store counts the ranks that came, it does not name "
     "them): start every rank, with MASTER_ADDR:MASTER_PORT node0:6000 reachable from its "
     "node"),
    (("DistNetworkError", "The client socket has timed out after 60000ms while trying to "
                          "connect to (node0, 6000)."),
     "rank 2: rank 0 did not answer within 60 s (--distributed-timeout-minutes 1): its store "
     "at node0:6000 (MASTER_ADDR:MASTER_PORT) cannot be reached; start rank 0, or give the "
     "address of its node"),
])
def test_a_rendezvous_that_does_not_complete_is_one_line(error, line, monkeypatch):
    import torch.distributed as dist

    from megatron.training.distributed import collective_timeout, rendezvous_failure

    monkeypatch.setenv("RANK", line.split(":")[0].split()[1])
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "6000")
    kind, text = error
    assert str(rendezvous_failure(getattr(dist, kind)(text), collective_timeout(1))) == line


def test_every_gloo_group_waits_as_long_as_the_flag_says(monkeypatch):
    """torch gives a new group 30 minutes, whatever the default group has: the runtime's
    groups (checkpoint writer, host group, data-parallel groups, replica pushes) get the
    job's timeout instead. The test stand-in must be a number of seconds."""
    from megatron.pipeline.host_group import gloo_group
    from megatron.training.distributed import (
        CollectiveTimeout,
        collective_timeout,
        initialize_distributed,
        shutdown_distributed,
    )

    assert str(collective_timeout(10)) == "600 s (--distributed-timeout-minutes 10)"
    shutdown_distributed()  # initialize_distributed is idempotent: an earlier test's group stays
    initialize_distributed(timeout=CollectiveTimeout(7.0, "test"))
    try:
        options = gloo_group()._get_backend(torch.device("cpu")).options
        assert options._timeout.total_seconds() == 7.0
    finally:
        shutdown_distributed()
    monkeypatch.setenv("MEGATRON_SYSX_TEST_TIMEOUT_S", "0")
    with pytest.raises(ConfigError, match="MEGATRON_SYSX_TEST_TIMEOUT_S 0: expected seconds"):
        collective_timeout(10)
