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

Part 2, stage_step(): one pipeline stage's optimizer step (--params parameters in fp32:
12 bytes each of master, m and v, cut into --groups groups) through the runtime's own path:
a CPUAdamW with disk=DiskStates(window --window), every read asked for, every write asked
for, the steps in order, the commits, then DiskStates.settle_all(); timed from the first
request to the last write done, after one untimed step (the window's first touch). In the
same interleaved rounds, on the same directory, the part 1 references write and read a
file of the stage's state bytes: the disk's limit for the step is state_bytes / read_bw + state_bytes / write_bw (the best reference per
direction), and ours_over_disk_limit = limit time / our time. The same step with the
states in host memory (no disk) shows the CPU time the I/O hides, and with a window of
every group (ours_windowG, another file) what the window's bound on host memory costs.

Part 3, iteration(): pretrain_llama.py --pipeline-schedule decoupled on 2 processes
(torchrun, OMP_NUM_THREADS=1; --train-iters 12 unless --presets says, e.g. small:5) with
the optimizer states on NVMe (--optimizer-state-location nvme on --dir) and in host
memory, alternating over the rounds; per run the median iteration time and exposed
optimizer time past the first 2 iterations.

    .venv/bin/python bench/nvme_optimizer.py --dir /var/tmp --bytes 512MiB --params 100M \
        --presets tiny,small:5 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.spread import spread  # noqa: E402
from megatron.offload.reaper_client import REAPER  # noqa: E402
from megatron.optimizer.cpu_adam import CPUAdamW  # noqa: E402
from megatron.optimizer.disk_states import DiskStates  # noqa: E402
from megatron.optimizer.state_io import (  # noqa: E402
    Engine,
    StateFile,
    aligned_empty,
    direct_io_supported,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

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


def reference_methods() -> dict[str, Method]:
    """The references that are not our engine (dd alone, dd as several streams, a loop)."""
    return {"dd": dd_method(1), f"dd_x{DD_STREAMS}": dd_method(DD_STREAMS),
            "pwritev_loop": pwritev_loop}


def _whole_dd_blocks(nbytes: int) -> int:
    """nbytes rounded down to whole dd blocks for every stream (at least one each)."""
    unit = DD_BLOCK * DD_STREAMS
    return max(unit, nbytes // unit * unit)


def _require_disk(directory: str) -> None:
    if filesystem_of(directory) in ("tmpfs", "ramfs") or not direct_io_supported(directory):
        raise RuntimeError(f"{directory} does not take O_DIRECT: choose a directory on a disk")


def disk_limit(directory: str, nbytes: int = 1 << 30, rounds: int = 5) -> dict:
    """The disk's O_DIRECT sequential write and read bandwidth by the references, and our
    Engine's at each configuration against it, interleaved over rounds. Bytes/s."""
    nbytes = _whole_dd_blocks(nbytes)
    _require_disk(directory)
    methods = reference_methods()
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


def parse_count(text: str) -> int:
    """'100M', '50M', '1G', '250000' -> a count of parameters."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 100M, 50M or 250000")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])


def _disk_step(adam: CPUAdamW, disk: DiskStates, grads: list[torch.Tensor],
               outs: list[torch.Tensor]) -> tuple[float, float]:
    """One step of every group as a program drives it: seconds from the first request to
    the last write done, and of them those after the last group's step (the writes left)."""
    start = time.perf_counter()
    for g in range(adam.num_groups):
        adam.storage.request_read(g)
    for g in range(adam.num_groups):
        adam.storage.request_write(g)
    for g in range(adam.num_groups):
        adam.step_group(g, grads[g], out=outs[g])
    stepped = time.perf_counter()
    for g in range(adam.num_groups):
        adam.commit_group(g)
    disk.settle_all()
    end = time.perf_counter()
    return end - start, end - stepped


def _host_step(adam: CPUAdamW, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    """The same step with the states in host memory: the CPU time the I/O must hide."""
    start = time.perf_counter()
    for g in range(adam.num_groups):
        adam.step_group(g, grads[g], out=outs[g])
        adam.commit_group(g)
    return time.perf_counter() - start


def _fdatasync(path: str) -> float:
    """Seconds a flush of the file's data to the drive takes (after O_DIRECT: its cache)."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def stage_step(directory: str, params: int = 100_000_000, groups: int = 8, rounds: int = 3,
               window: int = 2, whole_window: bool = True) -> dict:
    """A stage's optimizer step with its states streamed from and to a file on `directory`
    (DiskStates, as the runtime does) against the disk's limit for the same bytes,
    measured by the references in the same interleaved rounds. With whole_window, the same
    step again with a window of every group (no read waits for a buffer) shows what the
    window's bound costs."""
    _require_disk(directory)
    if groups < 1 or params < groups:
        raise ValueError(f"params={params}, groups={groups}: expected 1 <= groups <= params")
    numels = [params // groups + (g < params % groups) for g in range(groups)]
    windows = [window] + ([groups] if whole_window and groups > window else [])
    scratch = tempfile.mkdtemp(prefix="bench-nvme-stage-", dir=directory)
    disks: dict[str, DiskStates] = {}
    try:
        gen = torch.Generator().manual_seed(0)
        start = [torch.randn(n, generator=gen) for n in numels]
        hyper = dict(lr=1e-4, weight_decay=0.1)
        on_disk: dict[str, CPUAdamW] = {}
        for w in windows:
            name = "ours" if w == window else f"ours_window{w}"
            # one class of groups: `w` buffers of the (equal) groups, as the runtime's window
            # of large decayed groups (the small no-decay groups it also holds are absent)
            disks[name] = DiskStates(scratch, numels, torch.float32, torch.float32, window=w,
                                     job=f"bench-w{w}", rank=0, tracker=REAPER,
                                     log=lambda line: print(line, file=sys.stderr))
            on_disk[name] = CPUAdamW(start, disk=disks[name], **hyper)
        in_host = CPUAdamW(start, **hyper)
        del start
        grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in numels]
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in numels]
        # read, then written, once per step
        state_bytes = sum(r.version_bytes for r in disks["ours"].regions)
        ref_bytes = _whole_dd_blocks(state_bytes)
        ref_path = os.path.join(scratch, "reference.bin")
        StateFile(ref_path, ref_bytes, Engine(1, MiB)).close(unlink=False)
        buf = aligned_empty(ref_bytes)
        buf.copy_(torch.randint(0, 256, (ref_bytes,), dtype=torch.uint8, generator=gen))
        references = reference_methods()
        names = [*references, *on_disk, "host_step"]
        ref_times: dict[str, list[tuple[float, float]]] = {name: [] for name in references}
        ours: dict[str, list[float]] = {name: [] for name in on_disk}
        tails: dict[str, list[float]] = {name: [] for name in on_disk}
        host: list[float] = []
        sync: list[float] = []
        # one untimed step each: the window buffers' first touch (page faults on 2 x the
        # group size) is paid once per job, not per step
        first = {name: _disk_step(adam, disks[name], grads, outs)[0]
                 for name, adam in on_disk.items()}
        _host_step(in_host, grads, outs)
        print(f"stage step warm-up: {first}", file=sys.stderr)
        for round_ in range(rounds):
            k = round_ * len(names) // rounds  # rotate which goes first
            for name in names[k:] + names[:k]:
                if name in on_disk:
                    total, tail = _disk_step(on_disk[name], disks[name], grads, outs)
                    ours[name].append(total)
                    tails[name].append(tail)
                    said = f"{total:.2f} s ({tail:.2f} s after the last step)"
                    if name == "ours":  # the runtime never syncs: what a flush adds after
                        sync.append(_fdatasync(disks[name].path))
                        said += f" (+ fdatasync {sync[-1]:.3f} s)"
                elif name == "host_step":
                    host.append(_host_step(in_host, grads, outs))
                    said = f"{host[-1]:.2f} s"
                else:
                    w, r = references[name](ref_path, ref_bytes, buf)
                    ref_times[name].append((w, r))
                    said = f"write {w:.2f} s read {r:.2f} s"
                print(f"stage step round {round_ + 1}: {name} {said}", file=sys.stderr)
        for adam in on_disk.values():
            if any(adam.step_count(g) != in_host.step_count(g) for g in range(groups)):
                raise RuntimeError("the disk and host optimizers took different numbers of steps")
    finally:
        for disk in disks.values():
            disk.close()
        shutil.rmtree(scratch, ignore_errors=True)
    rates = {name: _rates(ref_bytes, t) for name, t in ref_times.items()}
    read_bw = [max(r["read"][i] for r in rates.values()) for i in range(rounds)]
    write_bw = [max(r["write"][i] for r in rates.values()) for i in range(rounds)]
    limit = [state_bytes / r + state_bytes / w for r, w in zip(read_bw, write_bw)]
    report = {
        "params": params, "groups": groups, "window": window,
        "state_bytes": state_bytes, "state_file_bytes": 2 * state_bytes,
        "reference_bytes": ref_bytes, "rounds": rounds,
        "disk_limit_read_bytes_per_s": _rounded(spread(read_bw), None),
        "disk_limit_write_bytes_per_s": _rounded(spread(write_bw), None),
        "disk_limit_s": _rounded(spread(limit), 3),
        "host_memory_step_s": _rounded(spread(host), 3),
        "ours_fdatasync_after_s": _rounded(spread(sync), 4),
        "first_step_s": {name: round(t, 3) for name, t in first.items()},  # untimed warm-up
    }
    for name, times in ours.items():
        report[f"{name}_s"] = _rounded(spread(times), 3)
        report[f"{name}_writes_after_last_step_s"] = _rounded(spread(tails[name]), 3)
        report[f"{name}_over_disk_limit"] = _rounded(
            spread([lim / t for lim, t in zip(limit, times)]), 3)
        report[f"{name}_bytes_per_s"] = _rounded(
            spread([2 * state_bytes / t for t in times]), None)
    report["reference_bytes_per_s"] = {
        name: {kind: _rounded(spread(v), None) for kind, v in r.items() if kind != "combined"}
        for name, r in rates.items()}
    return report


def _train(preset: str, metrics: str, extra: list[str], train_iters: int) -> list[dict]:
    """One 2-process run of pretrain_llama.py; its training rows of the metrics file."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_llama.py"), "--model-preset", preset,
           "--pipeline-schedule", "decoupled", "--train-iters", str(train_iters),
           "--metrics-file", metrics, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-3000:]}")
    if extra and "optimizer states on NVMe in" not in proc.stdout:
        raise RuntimeError(f"{' '.join(cmd)}: the states did not go to NVMe")
    with open(metrics) as f:
        return [row for row in map(json.loads, f) if "evaluation" not in row]


def iteration(directory: str, preset: str = "tiny", rounds: int = 3, train_iters: int = 12,
              skip: int = 2) -> dict:
    """The 2-process iteration with the optimizer states on NVMe (a file on `directory`)
    against host memory, alternating which goes first; per run the medians of the
    iteration time and the exposed optimizer time past the first `skip` iterations."""
    _require_disk(directory)
    scratch = tempfile.mkdtemp(prefix="bench-nvme-iter-", dir=directory)
    drive = os.path.join(scratch, "drive")
    os.mkdir(drive)
    locations = {"host": [], "nvme": ["--optimizer-state-location", "nvme",
                                      "--optimizer-nvme-path", drive]}
    runs: dict[str, list[dict]] = {name: [] for name in locations}
    try:
        for round_ in range(rounds):
            order = list(locations) if round_ % 2 == 0 else list(reversed(locations))
            for name in order:
                metrics = os.path.join(scratch, f"{name}-{round_}.jsonl")
                rows = _train(preset, metrics, locations[name], train_iters)[skip:]
                if os.listdir(drive):
                    raise RuntimeError(f"{drive}: state files left behind: {os.listdir(drive)}")
                runs[name].append({
                    "iter_s": statistics.median(r["iter_time_s"] for r in rows),
                    "exposed_optimizer_s": statistics.median(
                        r["exposed_optimizer_time_s"] for r in rows),
                    "host_optimizer_state_bytes": rows[-1]["host_optimizer_state_bytes"],
                })
                print(f"iteration {preset} round {round_ + 1}: {name} "
                      f"{runs[name][-1]['iter_s']:.3f} s, exposed optimizer "
                      f"{runs[name][-1]['exposed_optimizer_s']:.4f} s", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "preset": preset, "train_iters": train_iters, "skipped_iterations": skip,
        "rounds": rounds,
        "locations": {name: {
            "iteration_s": _rounded(spread([r["iter_s"] for r in rs]), 4),
            "exposed_optimizer_s": _rounded(spread([r["exposed_optimizer_s"] for r in rs]), 4),
            "host_optimizer_state_bytes": rs[-1]["host_optimizer_state_bytes"],
        } for name, rs in runs.items()},
        # per round, the NVMe run's median iteration over the host run's
        "nvme_over_host_iteration": _rounded(spread(
            [n["iter_s"] / h["iter_s"] for n, h in zip(runs["nvme"], runs["host"])]), 3),
    }


def machine() -> dict:
    """What ran the benchmark: the CPU, its cores and whether it has AVX-512."""
    model, flags = "", ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    return {"cpu": model or platform.machine(), "usable_cores": len(os.sched_getaffinity(0)),
            "avx512f": "avx512f" in flags.split(), "python": platform.python_version(),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp",
                   help="a directory on the disk to measure (not tmpfs); default /var/tmp")
    p.add_argument("--bytes", type=parse_bytes, default=1 << 30,
                   help="part 1's file size, e.g. 1GiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--params", type=parse_count, default=100_000_000,
                   help="part 2's stage, in fp32 parameters (12 bytes of state each), e.g. 50M")
    p.add_argument("--groups", type=int, default=8, help="part 2's groups of the stage")
    p.add_argument("--window", type=int, default=2, help="part 2's window, in groups")
    p.add_argument("--no-whole-window", action="store_true",
                   help="part 2: skip the comparison step with a window of every group")
    p.add_argument("--presets", default="tiny",
                   help="part 3's model presets, comma-separated, each with its training "
                        "iterations after a colon (default 12), e.g. tiny,small:5")
    p.add_argument("--parts", default="disk,stage_step,iteration",
                   help="which parts to run, comma-separated")
    p.add_argument("--json", action="store_true", help="one line of JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds >= 1 expected")
    parts = set(args.parts.split(","))
    if parts - {"disk", "stage_step", "iteration"}:
        p.error(f"--parts {args.parts}: expected some of disk,stage_step,iteration")
    report: dict = {"benchmark": "optimizer states on NVMe: the disk, a stage's step, "
                                 "the iteration", "machine": machine()}
    if "disk" in parts:
        report["disk"] = disk_limit(args.dir, args.bytes, args.rounds)
    if "stage_step" in parts:
        report["stage_step"] = stage_step(args.dir, args.params, args.groups, args.rounds,
                                          args.window, not args.no_whole_window)
    if "iteration" in parts:
        report["iteration"] = {}
        for item in args.presets.split(","):
            preset, _, iters = item.partition(":")
            report["iteration"][preset] = iteration(args.dir, preset, args.rounds,
                                                    int(iters or 12))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
