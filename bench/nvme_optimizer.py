"""Optimizer states on a disk: what the disk itself sustains, and how close the state-file
engine (megatron.optimizer.state_io) comes to it.

    .venv/bin/python bench/nvme_optimizer.py --dir /nvme/scratch --bytes 512MiB --rounds 3

Part 1, disk_limit(): one file of --bytes on --dir (a disk, not tmpfs), written then read
with O_DIRECT, so the page cache plays no part, by references that are not our engine: dd
(oflag/iflag=direct, bs=4M) as one process and as 4 processes on quarters of the file (the
drive's limit may need several requests in flight), and a single-threaded os.pwritev/preadv
loop over 4 MiB pieces of random bytes; then by our Engine on the same file and bytes at
1, 2, 4 and 8 threads and 1 and 4 MiB chunks. Every write ends with fdatasync, so it counts
until the data is on the drive. The methods rotate which goes first each round. Prints the
median and range (min-max) of bytes/s per method, the disk's limit (the best reference),
and per engine configuration engine_over_disk_limit: its bytes/s over the best reference
of the same round for reads, writes and the combined write+read time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.spread import spread  # noqa: E402
from megatron.optimizer.state_io import (  # noqa: E402
    Engine,
    StateFile,
    aligned_empty,
    direct_io_supported,
)

MiB = 1 << 20
DD_BLOCK = 4 * MiB
DD_STREAMS = 4
ENGINE_CONFIGS = [(t, c) for t in (1, 2, 4, 8) for c in (MiB, 4 * MiB)]

# A method writes then reads nbytes of the file and returns (write seconds, read seconds).
Method = Callable[[str, int, torch.Tensor], tuple[float, float]]


def parse_bytes(text: str) -> int:
    """'512MiB', '1GiB', '4096' -> bytes."""
    m = re.fullmatch(r"(\d+)\s*(|KiB|MiB|GiB)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 4096, 512MiB or 1GiB")
    return int(m.group(1)) << {"": 0, "KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)]


def filesystem_of(directory: str) -> str:
    """The filesystem type of directory's mount (the longest mount point that holds it)."""
    path, best = os.path.realpath(directory), ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fstype)
    return best[1]


def _timed(cmds: list[list[str]]) -> float:
    """Runs the commands at once; the seconds until the last one finished."""
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]
    for p, c in zip(procs, cmds):
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(c)}: exit {p.returncode}: {err.decode()[-500:]}")
    return time.perf_counter() - start


def dd_method(streams: int) -> Method:
    """dd with O_DIRECT, `streams` processes each on its own slice of the file."""
    def run(path: str, nbytes: int, _: torch.Tensor) -> tuple[float, float]:
        blocks = nbytes // DD_BLOCK // streams
        writes = [["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK}", f"count={blocks}",
                   f"seek={k * blocks}", "oflag=direct", "conv=notrunc,fdatasync"]
                  for k in range(streams)]
        reads = [["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", f"count={blocks}",
                  f"skip={k * blocks}", "iflag=direct"] for k in range(streams)]
        return _timed(writes), _timed(reads)
    return run


def pwritev_loop(path: str, nbytes: int, buf: torch.Tensor) -> tuple[float, float]:
    """A single-threaded O_DIRECT os.pwritev/os.preadv loop over 4 MiB pieces of buf."""
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, DD_BLOCK):
            piece = view[offset:offset + DD_BLOCK]
            done = 0
            while done < len(piece):  # a short write goes on where it stopped
                done += os.pwritev(fd, [piece[done:]], offset + done)
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, DD_BLOCK):
            piece = view[offset:offset + DD_BLOCK]
            done = 0
            while done < len(piece):
                n = os.preadv(fd, [piece[done:]], offset + done)
                if n == 0:
                    raise RuntimeError(f"{path}: read past the end at {offset + done}")
                done += n
        return write_s, time.perf_counter() - start
    finally:
        os.close(fd)


def engine_method(threads: int, chunk_bytes: int) -> Method:
    """Our Engine: the whole buffer as one write ticket, then one read ticket."""
    def run(path: str, nbytes: int, buf: torch.Tensor) -> tuple[float, float]:
        engine = Engine(threads, chunk_bytes)
        f = StateFile(path, nbytes, engine)
        try:
            if not f.direct:
                raise RuntimeError(f"{path}: O_DIRECT not in effect")
            start = time.perf_counter()
            f.write_from(buf, 0).wait()
            os.fdatasync(f.fd)
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            f.read_into(buf, 0).wait()
            return write_s, time.perf_counter() - start
        finally:
            f.close(unlink=False)
            engine.shutdown()
    return run


def _rounded(summary: dict, digits: int | None) -> dict:
    return {k: round(v, digits) for k, v in summary.items()}


def _rates(nbytes: int, times: list[tuple[float, float]]) -> dict:
    return {"write": [nbytes / w for w, _ in times], "read": [nbytes / r for _, r in times],
            "combined": [2 * nbytes / (w + r) for w, r in times]}


def disk_limit(directory: str, nbytes: int = 1 << 30, rounds: int = 5) -> dict:
    """The disk's O_DIRECT sequential write and read bandwidth by the references, and our
    Engine's at each configuration against it, interleaved over rounds. Bytes/s."""
    unit = DD_BLOCK * DD_STREAMS
    nbytes = max(unit, nbytes // unit * unit)  # whole dd blocks for every stream
    if filesystem_of(directory) in ("tmpfs", "ramfs") or not direct_io_supported(directory):
        raise RuntimeError(f"{directory} does not take O_DIRECT: choose a directory on a disk")
    methods: dict[str, Method] = {"dd": dd_method(1), f"dd_x{DD_STREAMS}": dd_method(DD_STREAMS),
                                  "pwritev_loop": pwritev_loop}
    references = list(methods)
    for threads, chunk in ENGINE_CONFIGS:
        methods[f"engine_t{threads}_c{chunk // MiB}MiB"] = engine_method(threads, chunk)
    scratch = tempfile.mkdtemp(prefix="bench-nvme-", dir=directory)
    path = os.path.join(scratch, "states.bin")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    try:
        StateFile(path, nbytes, Engine(1, MiB)).close(unlink=False)  # reserve the blocks once
        buf = aligned_empty(nbytes)
        buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(0)))
        written = buf.clone()
        names = list(methods)
        for round_ in range(rounds):
            k = round_ * len(names) // rounds  # rotate which method goes first
            for name in names[k:] + names[:k]:
                times[name].append(methods[name](path, nbytes, buf))
                if name.startswith(("engine", "pwritev")) and not torch.equal(buf, written):
                    raise RuntimeError(f"{name}: the bytes read back differ from those written")
                print(f"round {round_ + 1}: {name} write {times[name][-1][0]:.2f} s "
                      f"read {times[name][-1][1]:.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rates = {name: _rates(nbytes, t) for name, t in times.items()}
    # per round, the best reference in each direction is the disk's limit of that round
    limit = {kind: [max(rates[r][kind][i] for r in references) for i in range(rounds)]
             for kind in ("write", "read", "combined")}
    return {
        "directory": directory, "filesystem": filesystem_of(directory), "bytes": nbytes,
        "rounds": rounds,
        "bytes_per_s": {name: {kind: _rounded(spread(v), None) for kind, v in r.items()}
                        for name, r in rates.items()},
        "disk_limit_bytes_per_s": {kind: _rounded(spread(v), None) for kind, v in limit.items()},
        "engine_over_disk_limit": {
            name: {kind: _rounded(spread([o / lim for o, lim in zip(rates[name][kind],
                                                                    limit[kind])]), 3)
                   for kind in limit}
            for name in methods if name not in references},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp",
                   help="a directory on the disk to measure (not tmpfs); default /var/tmp")
    p.add_argument("--bytes", type=parse_bytes, default=1 << 30, help="file size, e.g. 1GiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one line of JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds >= 1 expected")
    report = {"benchmark": "state files: O_DIRECT sequential write+read, references vs Engine",
              "disk": disk_limit(args.dir, args.bytes, args.rounds)}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
