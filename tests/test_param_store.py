"""Shared-memory parameter store in one process: naming, versions, bad input, cleanup."""

import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from megatron.offload.naming import resolve_job_id, segment_name
from megatron.offload.param_store import ParameterStore, job_segments
from megatron.offload.reaper_client import REAPER, REAPER_SCRIPT
from megatron.offload.shm import SegmentInUseError, SharedSegment
from megatron.offload.shm_header import MAGIC
from megatron.offload.shm_space import ShmSpaceError
from tests import forked_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def job_id():
    job = f"test-{uuid.uuid4().hex}"
    yield job
    leftovers = job_segments(job)
    for name in leftovers:  # keep /dev/shm clean even when a test fails
        os.unlink(os.path.join("/dev/shm", name))
    assert leftovers == [], f"segments left behind: {leftovers}"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def fake_stale_segment(path: str, pid: int) -> None:
    """What a process killed before any cleanup leaves: a complete segment file."""
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<6q", 3, 0, pid, 12345, 16, 3) + bytes(4096 - 56 + 32))


def test_job_id_precedence_follows_the_launcher():
    env = {"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_job_id("mine", env) == "mine"
    assert resolve_job_id(None, env) == "run:abc"
    env["TORCHELASTIC_RUN_ID"] = "none"  # torchrun's value when no rdzv id is given
    assert resolve_job_id(None, env) == "addr:10.0.0.1:29500"
    with pytest.raises(ValueError, match="job_id=None"):
        resolve_job_id(None, {})


def test_names_separate_jobs_nodes_and_stages():
    names = {
        segment_name(job, node, stage, sub)
        for job in ("addr:h:29500", "addr:h:29501")
        for node in (0, 1)
        for stage, sub in ((0, 0), (0, 1), (1, 0))
    }
    assert len(names) == 12


def test_readers_see_published_versions_through_the_same_memory(job_id):
    with ParameterStore(job_id=job_id, rank=0, procs_per_node=2) as owner_store:
        owner = owner_store.create((1, 0), 1000, torch.bfloat16)
        assert owner.version == -1
        reader = SharedSegment.attach(owner.path, 1000, torch.bfloat16)
        values = torch.linspace(-4, 4, 1000).to(torch.bfloat16)
        owner.write(values, version=1)
        assert reader.wait_version(1) == 1
        assert torch.equal(reader.params.view(torch.int16), values.view(torch.int16))
        owner.begin_write()  # a writer in progress hides the data from readers
        with pytest.raises(TimeoutError, match="stayed at version 1"):
            reader.wait_version(2, timeout_s=0.05)
        owner.params.mul_(2)
        owner.publish(2)
        assert reader.wait_version(2) == 2
        assert torch.equal(reader.params, values * 2)
        with pytest.raises(ValueError, match="already at 2"):
            owner.publish(2)
        reader.release()


def test_two_jobs_on_one_host_do_not_collide(job_id):
    other_job = job_id + "-other"
    try:
        with (
            ParameterStore(job_id=job_id, rank=0) as first,
            ParameterStore(job_id=other_job, rank=0) as second,
        ):
            a = first.create((0, 0), 64, torch.float16)
            b = second.create((0, 0), 64, torch.float16)
            a.write(torch.ones(64, dtype=torch.float16), 1)
            b.write(torch.full((64,), 2.0, dtype=torch.float16), 1)
            assert a.path != b.path
            assert torch.equal(a.params, torch.ones(64, dtype=torch.float16))
    finally:
        assert job_segments(other_job) == []


def test_same_job_id_with_a_live_owner_is_a_clear_error(job_id):
    with ParameterStore(job_id=job_id, rank=0) as first, ParameterStore(job_id=job_id) as again:
        first.create((0, 0), 64, torch.float16).write(torch.ones(64, dtype=torch.float16), 1)
        with pytest.raises(SegmentInUseError, match=f"belongs to live process {os.getpid()}"):
            again.create((0, 0), 64, torch.float16)
        assert torch.equal(first.get((0, 0)).params, torch.ones(64, dtype=torch.float16))


def test_stale_segment_of_a_dead_run_is_swept_by_the_next_start(job_id, private_shm_dir):
    store = ParameterStore(job_id=job_id, rank=0, shm_dir=private_shm_dir)
    fake_stale_segment(store.path((0, 0)), dead_pid())
    fake_stale_segment(store.path((0, 1)), dead_pid())
    restarted = ParameterStore(job_id=job_id, rank=0, shm_dir=private_shm_dir)
    ours = {os.path.basename(store.path(k)) for k in ((0, 0), (0, 1))}
    assert ours == set(restarted.swept)
    fake_stale_segment(store.path((2, 0)), dead_pid())  # appears after the sweep
    with pytest.warns(RuntimeWarning, match="removing stale shared-memory segment"):
        fresh = restarted.create((2, 0), 16, torch.bfloat16)
    assert fresh.version == -1 and fresh.numel == 16
    restarted.close()
    store.close()


def test_dev_shm_too_small_fails_before_creating_anything(job_id):
    store = ParameterStore(job_id=job_id, rank=0)
    # fp16 elements: a byte more than the whole file system holds; one more than is free
    # now could fit by the time it is created, when the suite's other session frees some
    # (and would then reserve all of /dev/shm)
    too_many = shutil.disk_usage("/dev/shm").total // 2 + 1
    with pytest.raises(ShmSpaceError, match=r"bytes free but .* --shm-size"):
        store.create((0, 0), too_many, torch.float16)
    with pytest.raises(ShmSpaceError, match="2 stage segments of node 0"):
        store.check_capacity({(0, 0): (10, torch.float16), (0, 1): (too_many, torch.float16)})
    assert job_segments(job_id) == []
    store.close()


def test_attach_checks_the_layout_and_waits_with_a_timeout(job_id):
    with ParameterStore(job_id=job_id, rank=0) as store:
        with pytest.raises(TimeoutError, match="did not appear"):
            store.attach((5, 0), timeout_s=0.05)
        store.create((5, 0), 32, torch.bfloat16)
        with pytest.raises(ValueError, match="layout mismatch"):
            SharedSegment.attach(store.path((5, 0)), 33, torch.bfloat16)


def test_exception_inside_the_store_context_removes_its_segments(job_id):
    with pytest.raises(RuntimeError, match="boom"), ParameterStore(job_id=job_id) as store:
        store.create((0, 0), 128, torch.bfloat16)
        assert len(job_segments(job_id)) == 1
        raise RuntimeError("boom")
    assert job_segments(job_id) == []


CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, sys.argv[4])  # the repository
    from megatron.offload.param_store import ParameterStore
    from megatron.offload.reaper_client import REAPER
    store = ParameterStore(job_id=sys.argv[1], rank=0)
    for key in ((0, 0), (0, 1)):
        store.create(key, 4096, torch.bfloat16).write(torch.ones(4096), 1)
    with open(sys.argv[3] + ".tmp", "w") as f:  # the reaper's pid, once the segments exist
        f.write(str(REAPER._proc.pid))
    os.replace(sys.argv[3] + ".tmp", sys.argv[3])
    if sys.argv[2] == "raise":
        raise RuntimeError("uncaught error in a rank")
    time.sleep(120)
    """
)


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.multiproc  # starts ranks and kills them
def test_killed_rank_and_crashed_rank_leave_dev_shm_clean(job_id, tmp_path):
    # each rank a process of its own, forked from the session's preloaded zygote
    # (tests/forked_ranks.py: ends as an interpreter does, without a second torch import)
    script = tmp_path / "rank.py"
    script.write_text(CHILD)
    jobs = {mode: f"{job_id}-{mode}" for mode in ("kill", "raise")}
    reaper_files = {mode: tmp_path / f"reaper-{mode}" for mode in jobs}
    children = {mode: forked_ranks.start(str(script), [job, mode, str(reaper_files[mode]), REPO])
                for mode, job in jobs.items()}
    try:
        wait_until(lambda: all(reaper_files[m].exists() or not c.running()
                               for m, c in children.items()), 120)
        reapers = {mode: int(f.read_text()) for mode, f in reaper_files.items() if f.exists()}
        mid_run = len(job_segments(jobs["kill"]))
    finally:
        children["kill"].kill()  # SIGKILL: no Python cleanup runs in the child
        killed, crashed = (children[mode].wait(timeout=30) for mode in ("kill", "raise"))
    assert reapers.keys() == jobs.keys(), killed.stderr[-3000:] + crashed.stderr[-3000:]
    assert mid_run == 2  # mid-run: the segments exist
    assert killed.returncode == -9
    assert crashed.returncode == 1
    for mode, job in jobs.items():
        assert wait_until(lambda job=job: job_segments(job) == []), f"{mode}: left behind"
        assert wait_until(lambda mode=mode: pid_gone(reapers[mode])), f"{mode}: reaper alive"


@pytest.mark.multiproc  # kills and restarts the reaper process
def test_a_killed_reaper_is_restarted_and_still_covers_earlier_segments(job_id):
    with ParameterStore(job_id=job_id, rank=0) as store:
        store.create((0, 0), 64, torch.bfloat16)
        first_reaper = REAPER._proc
        first_reaper.kill()
        first_reaper.wait()
        store.create((0, 1), 64, torch.bfloat16)  # finds the pipe broken: restarts
        assert REAPER.running and REAPER._proc.pid != first_reaper.pid
        REAPER.stop()  # what the reaper sees when this process dies: EOF
        assert job_segments(job_id) == []


@pytest.mark.multiproc  # starts a (short) reaper process
def test_the_reaper_runs_alone_on_the_stdlib(tmp_path):
    """As launched (-I), without site-packages (-S: no torch) and from another directory."""
    mine, recreated = tmp_path / "mine", tmp_path / "recreated"
    fake_stale_segment(str(mine), 4242)
    fake_stale_segment(str(recreated), 4343)  # tracked by 4242, re-created by another run
    reaper = subprocess.run(
        [sys.executable, "-I", "-S", REAPER_SCRIPT],
        input=f"+4242 {mine}\n+4242 {recreated}\n",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert reaper.returncode == 0, reaper.stderr
    assert not mine.exists() and recreated.exists()
