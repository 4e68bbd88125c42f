"""Start-up checks that hold: a --save path through a symbolic link that leads nowhere is
refused at start (not at the first save); an optimizer state file the drive cannot hold is
one line naming it, with nothing left behind; the sweep of dead processes' segments leaves
another user's alone instead of failing; a data cache this user cannot write is one line;
ulimit -n and ulimit -v too low for the run are refused before anything connects."""

import os
import resource
import signal
import stat

import pytest
import torch

from megatron.config.errors import ConfigError
from megatron.data.cache import file_lock
from megatron.offload.reaper_client import REAPER
from megatron.offload.shm_header import HEADER_BYTES, write_header
from megatron.offload.shm_owner import remove_if_stale
from megatron.optimizer.disk_states import DiskStateError, DiskStates
from megatron.training.arguments import parse_args
from megatron.training.process_limits import (
    check_address_space,
    check_open_files,
    check_process_limits,
)
from tests.in_child import as_nobody, error_line_in_child
from tests.test_training_loop import _train_rejects

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_save_path_through_a_link_that_leads_nowhere_is_refused_at_start(tmp_path, kind):
    link = tmp_path / "ckpt"
    if kind == "dangling":
        link.symlink_to(tmp_path / "gone")
        reason = f"to {tmp_path / 'gone'}, which does not exist"
    else:
        link.symlink_to(link)
        reason = "that loops"
    error = _train_rejects(tmp_path, "--save", str(link / "run1"))
    assert str(error) == (f"--save {link / 'run1'}: expected a writable directory; it is a "
                          f"symbolic link ({link}) {reason}")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_state_file_the_drive_cannot_hold_is_one_line_and_leaves_nothing(tmp_path):
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, previous[1]))  # a drive of 1 MiB
    try:
        with pytest.raises(DiskStateError) as error:
            DiskStates(tmp_path, [2**20], torch.float32, torch.float32, window=1,
                       job="full", rank=0, tracker=REAPER)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)
    line = str(error.value)
    assert "\n" not in line and "cannot be created (File too large; it takes 24.00 MiB" in line
    assert os.listdir(tmp_path) == []


def test_the_sweep_leaves_another_users_stale_segment_alone(tmp_path):
    shared = tmp_path / "shm"  # a sticky, world-writable directory, as /dev/shm is
    shared.mkdir()
    shared.chmod(0o1777 | stat.S_IRWXU)
    tmp_path.chmod(0o755)
    segment = shared / "mlm-stale"
    header = bytearray(HEADER_BYTES)
    write_header(header, pid=2**22 + 12345, start_time=1, numel=1, dtype_code=0)  # dead
    segment.write_bytes(bytes(header))
    segment.chmod(0o644)
    child = os.fork()
    if child == 0:  # as another user: the sweep must neither fail nor remove it
        code = 3
        try:
            as_nobody()
            code = 0 if remove_if_stale(str(segment)) is False else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert segment.exists()
    assert remove_if_stale(str(segment)) is True  # its owner's sweep does remove it


def test_a_cache_this_user_cannot_write_is_one_line(tmp_path):
    cache = tmp_path / "cache"  # root's: another user may not create its lock files
    cache.mkdir()
    tmp_path.chmod(0o755)

    def lock_as_nobody() -> None:
        as_nobody()
        with file_lock(str(cache / "corpus.lock"), str(cache)):
            pass

    message = error_line_in_child(lock_as_nobody, (ConfigError,))
    assert message == (f"--data-cache-path {cache}: expected a cache directory this user can "
                       "write (Permission denied); give another with --data-cache-path or "
                       "$MEGATRON_SYSX_CACHE")


def test_a_cache_path_through_a_file_names_the_flag_and_path_given(tmp_path, capsys):
    """Not the index directory under it, nor the other spelling of the flag."""
    from megatron.training.training import main

    (tmp_path / "F").write_text("x")
    given = tmp_path / "F" / "cache"
    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
              "--data-cache-path", str(given)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_llama.py: error: --data-cache-path {given}: expected a cache directory "
        "this user can write (Not a directory); give another with --data-cache-path or "
        "$MEGATRON_SYSX_CACHE"]


def _in_child(check) -> str:
    """Run `check()` in a forked child (the limits it sets stay there); its ConfigError's
    line, or '' when it raised none."""
    return error_line_in_child(check, (ConfigError,))


def test_ulimit_n_and_v_too_low_for_the_run_are_one_line_each():
    run = parse_args(["--model-preset", "tiny"])

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        check_process_limits(run, world_size=2)

    def soft_only():  # a soft limit below the hard one is raised: no error
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        check_open_files(world_size=2)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64

    def little_address_space():  # room for what is mapped, not for the threads' arenas
        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) for line in status if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, ((mapped + 100 * 1024) * 1024,
                                                resource.RLIM_INFINITY))
        check_address_space(run, own_state_bytes=0)

    assert _in_child(few_descriptors).startswith("open files: ulimit -n 64 is below the ")
    assert _in_child(soft_only) == ""
    message = _in_child(little_address_space)
    assert message.startswith("address space: ulimit -v ") and "malloc arenas" in message


_LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("change,line", [
    ({"RANK": "abc"}, "environment variable RANK 'abc': expected a whole number >= 0"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE '0': expected a whole number >= 1"),
    ({"LOCAL_RANK": "zz"}, "environment variable LOCAL_RANK 'zz': expected a whole number"),
    ({"LOCAL_WORLD_SIZE": "q"}, "environment variable LOCAL_WORLD_SIZE 'q': expected a whole"),
    ({"RANK": "2"}, "environment variable RANK 2: expected a rank below WORLD_SIZE 2"),
    ({"LOCAL_RANK": "2"}, "environment variable LOCAL_RANK 2: expected a rank below "
                          "LOCAL_WORLD_SIZE 2"),
    ({"LOCAL_WORLD_SIZE": "4"}, "environment variable LOCAL_WORLD_SIZE 4: expected at most "
                                "WORLD_SIZE 2"),
    ({"MASTER_ADDR": None}, "environment variable MASTER_ADDR (not set): expected the address "
                            "of rank 0's node"),
    ({"MASTER_PORT": "http"}, "environment variable MASTER_PORT 'http': expected a TCP port "
                              "1-65535"),
    ({"MASTER_PORT": "70000"}, "environment variable MASTER_PORT '70000': expected a TCP port"),
])
def test_a_launcher_variable_torchrun_would_never_set_is_one_line(change, line, capsys,
                                                                  monkeypatch):
    """Before the command line is read: not a ValueError traceback from the first int()
    that reads it. The process whose own RANK is wrong says it (rank 0 may not see it)."""
    from megatron.training.training import main
    for name, value in {**_LAUNCHED, **change}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(["--model-preset", "tiny"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines() == [f"pretrain_llama.py: error: {err.split('error: ', 1)[1].strip()}"]
    assert line in err


def test_a_rank_alone_without_a_world_is_refused():
    """RANK 3 with no WORLD_SIZE (a variable left over from another launch) used to train
    as rank 0 of 1, its RANK ignored; Megatron-LM fails on it (rank 3 of a world of 1)."""
    from megatron.config.launcher_env import check_launcher_env, speaks_for_the_job
    with pytest.raises(ConfigError, match=r"RANK 3: expected a rank below WORLD_SIZE"):
        check_launcher_env({"RANK": "3"})
    assert speaks_for_the_job({"RANK": "3"}) and not speaks_for_the_job(_LAUNCHED | {"RANK": "1"})
    check_launcher_env({})  # one process: nothing to check
    check_launcher_env(_LAUNCHED)


def test_a_master_port_in_use_is_one_line(capsys, monkeypatch, tmp_path):
    """A launch by hand (RANK, WORLD_SIZE, MASTER_*) whose port another process holds."""
    import socket

    from megatron.training.training import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {**_LAUNCHED, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_:
            main(["--model-preset", "tiny", "--metrics-file", str(tmp_path / "m.jsonl")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert err == (f"pretrain_llama.py: error: environment variable MASTER_PORT {port}: in use "
                   "by another process on this node; expected a free port for rank 0's store")
    assert os.listdir(tmp_path) == []


def test_a_bad_cpu_device_memlock_is_refused_before_anything_starts(monkeypatch):
    """MEGATRON_CPU_DEVICE_MEMLOCK was read by the pipeline's set-up: its line came after
    the shared-memory segments were made, the model built and the plan printed."""
    from megatron.training.distributed import decide_device
    monkeypatch.setenv("MEGATRON_CPU_DEVICE_MEMLOCK", "lots")
    with pytest.raises(ConfigError, match="MEGATRON_CPU_DEVICE_MEMLOCK 'lots': expected a "
                                          "byte count"):
        decide_device()
