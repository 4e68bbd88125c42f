"""The state-file I/O engine: bytes written through it come back, on O_DIRECT and buffered
files; misaligned direct requests, full disks and failed reads surface as Python errors;
tickets can be waited from several threads; shutdown leaves no thread behind."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import tempfile
import threading
import time
import weakref

import pytest
import torch

from megatron.optimizer.state_io import (
    ALIGNMENT,
    Engine,
    StateFile,
    aligned_empty,
    direct_io_supported,
    disk_free_bytes,
    round_up,
    shared_engine,
)

CHUNK = 64 << 10  # small chunks, so that modest sizes still span many


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return buf


def round_trip(directory: str, engine: Engine, direct: bool) -> StateFile:
    """Writes random regions of several sizes (one page to many chunks) with every ticket in
    flight at once, reads them back likewise, and checks the bytes."""
    sizes = [ALIGNMENT, 3 * ALIGNMENT, CHUNK, CHUNK + ALIGNMENT, 7 * CHUNK + 5 * ALIGNMENT]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    f = StateFile(os.path.join(directory, "states.bin"), sum(sizes), engine, direct=direct)
    written = [random_bytes(n, seed) for seed, n in enumerate(sizes)]
    for t in [f.write_from(b, o) for b, o in zip(written, offsets)]:
        t.wait()
    read = [aligned_empty(n) for n in sizes]
    for r in read:
        r.zero_()
    tickets = [f.read_into(r, o) for r, o in zip(read, offsets)]
    for t in tickets:
        t.wait()
        assert t.done()
    for w, r in zip(written, read):
        assert torch.equal(w, r)
    return f


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None):
    """A fresh `fstype` mount in a temporary directory (needs root), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting {fstype} needs root")
    directory = tempfile.mkdtemp(prefix=f"state-io-{fstype}-")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, directory]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount {fstype}: {proc.stderr.strip()}")
    try:
        yield directory
    finally:
        # lazily if a failed test left a file open there: detached now, freed when closed
        if subprocess.run(["umount", directory], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", directory], check=True)
        os.rmdir(directory)


def test_aligned_empty_and_round_up():
    assert [round_up(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    for n in (1, 4096, 10_000):
        buf = aligned_empty(n)
        assert buf.dtype == torch.uint8 and buf.numel() == round_up(n)
        assert buf.data_ptr() % ALIGNMENT == 0
        buf.fill_(7)  # the whole view is writable memory of its own
        assert int(buf.sum()) == 7 * buf.numel()


def test_round_trip_direct(tmp_path):
    assert direct_io_supported(str(tmp_path)), "the test directory should accept O_DIRECT"
    engine = Engine(4, CHUNK)
    f = round_trip(str(tmp_path), engine, direct=True)
    assert f.direct
    assert f.nbytes == os.path.getsize(f.path)
    f.close()
    engine.shutdown()


def test_round_trip_on_dev_shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        f = round_trip(directory, shared_engine(2, CHUNK), direct=True)
        # tmpfs takes O_DIRECT since Linux 6.6, and refuses it before
        assert f.direct == direct_io_supported(directory)
        f.close()


def test_buffered_fallback_where_o_direct_is_refused():
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        if not direct_io_supported(d):  # an older kernel's tmpfs refuses it
            f = round_trip(d, shared_engine(2, CHUNK), direct=True)
            assert not f.direct
            f.close()
            return
    with mounted("ramfs") as directory:  # ramfs never takes O_DIRECT (nor fallocate)
        assert not direct_io_supported(directory)
        f = round_trip(directory, shared_engine(2, CHUNK), direct=True)
        assert not f.direct
        f.close()
        # buffered files take any alignment
        g = StateFile(os.path.join(directory, "odd"), 3 * ALIGNMENT, shared_engine(2, CHUNK))
        data = random_bytes(2 * ALIGNMENT, seed=5)
        g.write_from(data[1:1001], 17).wait()
        back = aligned_empty(ALIGNMENT)
        g.read_into(back[3:1003], 17).wait()
        assert torch.equal(back[3:1003], data[1:1001])
        g.close()


@pytest.mark.parametrize("what", ["address", "offset", "nbytes"])
def test_misaligned_direct_request_names_the_value(tmp_path, what):
    f = StateFile(tmp_path / "s.bin", 4 * ALIGNMENT, shared_engine(2, CHUNK))
    assert f.direct
    buf = aligned_empty(2 * ALIGNMENT)
    view, offset, value = {"address": (buf[512:512 + ALIGNMENT], 0, buf.data_ptr() + 512),
                           "offset": (buf[:ALIGNMENT], 512, 512),
                           "nbytes": (buf[:1000], 0, 1000)}[what]
    with pytest.raises(ValueError, match=f"{what}={value} is not a multiple of 4096"):
        f.write_from(view, offset)
    with pytest.raises(ValueError, match=f"{what}={value} "):
        f.read_into(view, offset)
    f.close()


def test_full_disk_raises_enospc():
    with mounted("tmpfs", "size=1m") as directory:
        engine = shared_engine(2, CHUNK)
        # a reservation beyond the capacity fails at open and leaves no file behind
        with pytest.raises(OSError) as info:
            StateFile(os.path.join(directory, "big"), 2 << 20, engine)
        assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("big")
        assert os.listdir(directory) == []
        # a write past the capacity (beyond the file's reservation) fails when waited
        f = StateFile(os.path.join(directory, "small"), ALIGNMENT, engine)
        assert 0 < disk_free_bytes(directory) <= 1 << 20
        buf = random_bytes(2 << 20, seed=1)
        ticket = engine.submit(f.fd, buf.data_ptr(), buf.numel(), 0, True)
        with pytest.raises(OSError) as info:
            engine.wait(ticket)
        assert info.value.errno == errno.ENOSPC == 28
        f.close()


def test_write_beyond_the_file_is_refused_and_read_past_eof_fails(tmp_path):
    engine = shared_engine(2, CHUNK)
    f = StateFile(tmp_path / "s.bin", ALIGNMENT, engine)
    buf = aligned_empty(2 * ALIGNMENT)
    with pytest.raises(ValueError, match="outside"):
        f.write_from(buf, 0)
    # the engine itself, asked to read beyond the end, reports the short file
    ticket = engine.submit(f.fd, buf.data_ptr(), buf.numel(), 0, False)
    with pytest.raises(OSError, match="read past the end") as info:
        engine.wait(ticket)
    assert info.value.errno == errno.EIO
    with pytest.raises(KeyError, match="already waited"):
        engine.wait(ticket)
    f.close()


def test_close_unlinks_and_is_idempotent(tmp_path):
    f = StateFile(tmp_path / "s.bin", 1, shared_engine(2, CHUNK))
    assert f.nbytes == ALIGNMENT and os.path.getsize(f.path) == ALIGNMENT
    f.close()
    assert not os.path.exists(f.path)
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.read_into(aligned_empty(ALIGNMENT), 0)
    g = StateFile(tmp_path / "kept.bin", ALIGNMENT, shared_engine(2, CHUNK))
    g.close(unlink=False)
    assert os.path.exists(g.path)


def test_shutdown_joins_every_thread(tmp_path):
    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    # the data first: torch starts its OpenMP threads at the first parallel operation of
    # the process, which would count here when this test runs first
    buf = random_bytes(8 * CHUNK, seed=2)
    before = tasks()
    engine = Engine(6, CHUNK)
    assert tasks() == before + 6
    f = StateFile(tmp_path / "s.bin", 8 * CHUNK, engine)
    ticket = f.write_from(buf, 0)
    engine.shutdown()  # finishes what was queued, then joins
    ticket.wait()
    assert tasks() == before
    with pytest.raises(RuntimeError, match="after shutdown"):
        f.write_from(buf, 0)
    engine.shutdown()
    f.close()
    engine = Engine(3, CHUNK)
    del engine  # the destructor joins too
    assert tasks() == before


def test_waits_from_several_threads(tmp_path):
    engine = Engine(4, CHUNK)
    f = StateFile(tmp_path / "s.bin", 64 * CHUNK, engine)
    data = random_bytes(f.nbytes, seed=3)
    f.write_from(data, 0).wait()
    # one ticket, waited from two threads at once (and again afterwards)
    back = aligned_empty(f.nbytes)
    ticket = f.read_into(back, 0)
    errors: list[BaseException] = []

    def wait(t) -> None:
        try:
            t.wait()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    both = [threading.Thread(target=wait, args=(ticket,)) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    assert errors == [] and ticket.done()
    ticket.wait()
    assert torch.equal(back, data)
    # many tickets, each waited by one of several threads
    pieces = [aligned_empty(CHUNK) for _ in range(64)]
    tickets = [f.read_into(p, i * CHUNK) for i, p in enumerate(pieces)]
    threads = [threading.Thread(target=lambda ts: [wait(t) for t in ts], args=(tickets[k::4],))
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert torch.equal(torch.cat(pieces), data)
    f.close()
    engine.shutdown()


def test_forked_child_gets_an_engine_of_its_own(tmp_path):
    parent = shared_engine(2, CHUNK)
    with StateFile(tmp_path / "warm.bin", CHUNK, parent) as f:  # the parent's threads run
        f.write_from(random_bytes(CHUNK, seed=4), 0).wait()
    pid = os.fork()
    if pid == 0:  # child: a round trip through the shared engine, reported by exit status
        ok = False
        try:
            torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork
            child = shared_engine(2, CHUNK)
            f = round_trip(str(tmp_path), child, direct=True)
            f.close()
            ok = child is not parent
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if status[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung waiting on the parent's engine")
    assert os.waitstatus_to_exitcode(status[1]) == 0
    assert shared_engine(2, CHUNK) is parent


def test_a_ticket_holds_its_buffer_until_waited(tmp_path):
    engine = Engine(2, CHUNK)
    f = StateFile(tmp_path / "s.bin", 64 * CHUNK, engine)
    data = random_bytes(f.nbytes, seed=6)
    alive = weakref.ref(data)
    ticket = f.write_from(data, 0)
    del data
    assert alive() is not None  # the threads may still read it
    ticket.wait()
    assert alive() is None
    # a ticket dropped unwaited waits in its destructor: the engine has collected it
    data = random_bytes(f.nbytes, seed=7)
    dropped = f.write_from(data, 0)
    number = dropped._ticket
    del dropped
    with pytest.raises(KeyError, match="already waited"):
        engine.wait(number)
    back = aligned_empty(f.nbytes)
    f.read_into(back, 0).wait()
    assert torch.equal(back, data)
    f.close()
    engine.shutdown()
