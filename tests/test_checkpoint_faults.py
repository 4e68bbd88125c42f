"""A checkpoint that cannot be read ends in one line naming what, never a traceback: a
shard cut short in a checkpoint without checksums (megatron-core's have none), a tracker
that is not text, a --load directory this user may not read, a --load that is a file, a
recorded iteration below 0; a save the disk cannot hold, or into a directory turned
read-only, is a fault (exit 1) that keeps the last checkpoint."""

import os
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from megatron.config.errors import ConfigError
from megatron.training import run_checks
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_format import CHECKSUMS
from megatron.training.checkpointing import (
    COMMON,
    TRACKER,
    CheckpointError,
    CheckpointSaver,
    CheckpointWriteError,
    check_resumable,
    find_checkpoint,
    iteration_dir,
    load_checkpoint,
    reading_checkpoint,
    staging_dirs,
    write_failure,
)
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.run_checks import check_load_dir, check_save_space
from tests import forked_ranks
from tests.in_child import (
    as_nobody,
    error_line_in_child,
)
from tests.test_checkpointing import MODEL, empty_like, owned


@pytest.fixture(autouse=True)
def process_group():
    initialize_distributed()
    yield
    shutdown_distributed()


def saved(tmp_path) -> str:
    root = str(tmp_path / "ckpt")
    saver = CheckpointSaver(root, MODEL, async_save=False, log=lambda *_: None)
    saver.save(1, owned(1), {"consumed_samples": 8})
    saver.close()
    os.remove(os.path.join(iteration_dir(root, 1), CHECKSUMS))  # as megatron-core's
    return root


def test_a_truncated_shard_without_checksums_is_one_line(tmp_path):
    root = saved(tmp_path)
    shard = os.path.join(iteration_dir(root, 1), "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(root, empty_like(owned(1)), MODEL)
    assert str(error.value) == (f"{iteration_dir(root, 1)}: its tensors cannot be read (a "
                                "file ends early: truncated)")


def test_a_tracker_that_is_not_text_is_one_line(tmp_path):
    root = saved(tmp_path)
    (tmp_path / "ckpt" / TRACKER).write_bytes(b"\xff\xfe1")
    with pytest.raises(CheckpointError) as error:
        find_checkpoint(root)
    assert str(error.value) == (f"{root}/{TRACKER}: expected an iteration number, found "
                                "bytes that are not text (b'\\xff' at byte 0)")


def test_a_load_directory_this_user_may_not_read_is_one_line():
    shared = tempfile.mkdtemp(prefix="megatron-test-")  # reachable by another user
    os.chmod(shared, 0o755)
    try:
        _refused_to_another_user(saved(Path(shared)))
    finally:
        shutil.rmtree(shared)


def _refused_to_another_user(root: str) -> None:
    os.chmod(root, 0o700)  # root's: another user may not list it

    def find_as_nobody() -> None:
        as_nobody()
        with reading_checkpoint(root):
            find_checkpoint(root)

    shutdown_distributed()  # not forked into the child (tests/in_child.py)
    message = error_line_in_child(find_as_nobody, (CheckpointError,))
    assert message == (f"--load {root}: {root}: permission denied (expected a checkpoint "
                       "this user can read)")


def test_a_load_that_is_a_file_is_refused_even_when_optional(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError) as error:
        check_load_dir(parse_args(["--model-preset", "tiny", "--load", str(path), "--load-optional"]))
    assert str(error.value) == f"--load {path}: expected a checkpoint directory, found a file"


def test_a_negative_iteration_is_named_as_damage(tmp_path):
    root = saved(tmp_path)
    common_pt = os.path.join(iteration_dir(root, 1), COMMON)
    common = torch.load(common_pt, weights_only=False)
    torch.save({**common, "iteration": -5}, common_pt)
    (tmp_path / "ckpt" / TRACKER).unlink()  # the newest complete iteration is taken
    with pytest.raises(CheckpointError) as error:
        check_resumable(parse_args(["--model-preset", "tiny", "--load", root, "--global-batch-size", "8"]),
                        log=lambda *_: None)
    assert "records iteration -5; expected an iteration >= 0" in str(error.value)


def test_a_save_the_disk_cannot_hold_is_a_fault_and_keeps_the_last_checkpoint(tmp_path,
                                                                           monkeypatch):
    root = saved(tmp_path)
    saver = CheckpointSaver(root, MODEL, async_save=False, log=lambda *_: None)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, previous[1]))  # files stop at 2 KiB
    try:
        with pytest.raises(CheckpointWriteError) as error:
            saver.save(2, owned(2), {"consumed_samples": 16})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)
        saver.close()
    assert "\n" not in str(error.value)
    assert str(error.value).startswith(f"--save {root}: writing the checkpoint failed (")
    assert str(error.value).endswith("the previous checkpoint is intact")
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "1"
    assert staging_dirs(root) == []  # what it had written went: the disk is not kept full
    target = empty_like(owned(1))
    assert load_checkpoint(root, target, MODEL)["iteration"] == 1
    # A disk with a few KiB left shows through torch's zip writer as an internal error.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 4096))
    internal = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                            "vs 598")
    assert str(write_failure(root, internal)) == (
        f"--save {root}: writing the checkpoint failed (No space left on device: 4 KiB "
        "free); the previous checkpoint is intact")


def test_what_an_unfinished_save_staged_counts_as_free_space_at_the_next_start(
        tmp_path, monkeypatch):
    """A save killed mid-write leaves iter_N.tmp, which the next save removes before it
    writes: the start-up check of --save's space counts it as free, so that a disk it
    fills does not refuse the run that would clear it."""
    save = tmp_path / "ckpt"
    (save / "iter_0000010.tmp").mkdir(parents=True)
    (save / "iter_0000010.tmp" / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    run = parse_args(["--model-preset", "tiny", "--vocab-size", "128", "--save", str(save)])
    need = run_checks.checkpoint_bytes(run, 128)
    free = need - (1 << 19)  # short by half of what the staged file holds
    monkeypatch.setattr(run_checks.shutil, "disk_usage",
                        lambda _: shutil._ntuple_diskusage(1 << 40, 1 << 40, free))
    check_save_space(run, 128)
    shutil.rmtree(save / "iter_0000010.tmp")
    with pytest.raises(ConfigError, match="a checkpoint of this model needs at least"):
        check_save_space(run, 128)


@pytest.mark.multiproc  # a process of its own (tests/save_turned_read_only.py)
def test_a_save_directory_that_turns_read_only_mid_run_is_one_line_and_lets_go_of_its_lock(
        tmp_path):
    """The --save directory becomes read-only after the first checkpoint (a read-only
    mount over it, in a mount namespace of the test's own): the next save is one line that
    keeps the first checkpoint, and the lock's release that follows neither raises (no
    second traceback) nor keeps its descriptor."""
    save = str(tmp_path / "ckpt")
    # a fresh process (tests/save_turned_read_only.py): a fork of this one would inherit
    # its process groups without their threads, and the saver's own group hung it once
    done = forked_ranks.launch("tests/save_turned_read_only.py", [save], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, _, line = done.stdout.strip().splitlines()[-1].partition(":")
    if kind == "skip":
        pytest.skip(line)
    assert kind == "ok", done.stdout[-2000:]
    assert line == (f"--save {save}: writing the checkpoint failed ([Errno 30] Read-only "
                    f"file system: '{save}/iter_0000002.tmp'); the previous checkpoint is "
                    "intact")
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "1"
