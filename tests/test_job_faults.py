"""A rank that stops answering, or never joins, ends the job in one line per rank that
waited for it (exit status 1): the rank it waited for, what it waited at, the timeout and
the last checkpoint; and a second job on the --save directory of a job that is stuck so is
refused in one line, the stuck job's checkpoint left as it was.

The timeout is --distributed-timeout-minutes (whole minutes, as Megatron's); these tests
stand seconds in for it with MEGATRON_SYSX_TEST_TIMEOUT_S.
"""

import contextlib
import os
import re
import time
import uuid

import pytest

from megatron.common.ports import reserved_port
from megatron.common.save_lock import LOCK_NAME
from megatron.training.checkpointing import TRACKER, iteration_dir
from megatron.training.distributed import TEST_TIMEOUT_ENV
from megatron.training.training import main
from tests import forked_ranks

pytestmark = pytest.mark.multiproc
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--eval-iters", "0"]
# Long enough that no rank of a two-process job on a loaded two-core box waits this long
# for the other while both run; short enough for the suite.
TIMEOUT_S = 8


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The lone rank of test_a_rank_that_never_joins_is_one_line_naming_it, when selected,
    started with the module: its wait for the missing rank overlaps the stopped-rank test's
    wait, where the cores are otherwise idle."""
    needed = {name for item in request.session.items if item.module is request.module
              for name in item.fixturenames}
    runs = {}
    with contextlib.ExitStack() as ports:
        if "never_joined" in needed:
            port = ports.enter_context(reserved_port())  # for the lone rank's store alone
            env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), TEST_TIMEOUT_ENV: "2"}
            directory = tmp_path_factory.mktemp("never-joined")
            save = directory / "ckpt"
            job = forked_ranks.start("pretrain_llama.py", [*SMALL, "--train-iters", "1",
                                                           "--save", str(save)],
                                     torchrun=False, env=env)
            runs["never_joined"] = job, port, directory, save
        yield runs
        for job, *_ in runs.values():
            job.wait(timeout=120)  # gone even when no test waited for it


@pytest.fixture
def never_joined(started):
    job, port, directory, save = started["never_joined"]
    return job.wait(timeout=120), port, directory, save


def _stuck(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def test_a_stopped_rank_is_one_line_and_a_second_job_on_its_save_is_refused(
        tmp_path, demo_cache, capsys):
    """Rank 1 stops (as `kill -STOP` would) at the start of iteration 3, after two
    checkpoints: rank 0 waits for it at its first transfer, then ends in one line naming
    rank 1, the instruction, the timeout and checkpoint 2. Meanwhile a second job on the
    same --save is refused in one line naming the first."""
    save = tmp_path / "ckpt"
    run_id = f"test-{uuid.uuid4().hex}"
    job = forked_ranks.start("pretrain_llama.py", [
        *SMALL, "--train-iters", "6", "--save", str(save), "--save-interval", "1",
        "--data-cache-dir", demo_cache], 2,
        env={"MEGATRON_SYSX_TEST_FAIL": "1,3,0,stop", TEST_TIMEOUT_ENV: str(TIMEOUT_S),
             "TORCHELASTIC_RUN_ID": run_id})
    try:
        deadline = time.monotonic() + 240
        while not _stuck(job.pids[1]):
            assert job.running() and time.monotonic() < deadline, job.wait().stderr[-3000:]
            time.sleep(0.05)
        # the first job holds its --save while rank 0 waits: a second one is refused
        try:
            code = main([*SMALL, "--train-iters", "1", "--save", str(save)])
        except SystemExit as exc:
            code = exc.code
        second = capsys.readouterr().err.strip().splitlines()
        while job.running() and time.monotonic() < deadline + TIMEOUT_S:
            time.sleep(0.05)  # until rank 0 gives up; rank 1 stays stopped
        job.kill()  # the stopped rank at once (SIGTERM would wait for it to continue)
    finally:
        proc = job.wait(timeout=240)
    assert code == 2 and len(second) == 1, second
    assert second[0].startswith(f"pretrain_llama.py: error: --save {save}: in use by another "
                                f"running job (job {run_id}, pid {job.pids[0]} on ")

    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines()
              if line.strip() and not line.startswith("[forked_ranks]")]
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0's; rank 1 is stopped
    found = re.fullmatch(
        rf"pretrain_llama\.py: error: rank 0: rank 1 did not answer within {TIMEOUT_S} s "
        rf"\({TEST_TIMEOUT_ENV}\) while rank 0 waited at (\S+) .*peer=1 \(instruction \d+ of "
        r"iteration 3\): it stopped, hung or cannot be reached; the last checkpoint, "
        rf"iteration 2 in {re.escape(str(save))}, is intact \(resume with --load "
        rf"{re.escape(str(save))}\)", errors[0])
    assert found and found.group(1) in ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"), \
        errors[0]
    assert (save / TRACKER).read_text() == "2"
    assert os.path.isdir(iteration_dir(str(save), 2))
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", TRACKER]  # no lock
    assert forked_ranks.segments_left(f"run:{run_id}") == []


def test_a_rank_that_never_joins_is_one_line_naming_it(never_joined):
    """Rank 0 of two started alone (WORLD_SIZE=2, no rank 1): one line naming the missing
    rank and the timeout, exit status 1, nothing created."""
    proc, port, directory, save = never_joined
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"pretrain_llama.py: error: rank 0: only 1 of 2 ranks (WORLD_SIZE) joined within 2 s "
        f"({TEST_TIMEOUT_ENV}); missing: rank 1: start every rank, with MASTER_ADDR:MASTER_PORT "
        f"127.0.0.1:{port} reachable from its node"]
    assert not save.exists() and LOCK_NAME not in os.listdir(directory)
