"""Layout-free checkpoints in Megatron's directory convention, written without stopping.

    DIR/latest_checkpointed_iteration.txt      the tracker (written last)
    DIR/iter_NNNNNNN/.metadata                 torch.distributed.checkpoint's index
    DIR/iter_NNNNNNN/__R_0.distcp              the tensors rank R owned when saving
    DIR/iter_NNNNNNN/common.pt                 iteration, LR schedule, data position, ...

The tensors are keyed by GPTModel parameter name (see checkpoint_state), so any process of
any pipeline shape reads the ones it owns now: resuming on another number of processes,
schedule or backward split needs nothing else.

A save is collective. In the foreground every rank waits for its previous save, checks the
free disk space and copies the tensors it owns (the snapshot: host memory to host memory);
a background thread then writes them with torch.distributed.checkpoint over a gloo group
of its own, and rank 0 commits: `iter_N.tmp` is renamed to `iter_N`, then the tracker is
replaced. A crash before that leaves the previous checkpoint and tracker untouched.
"""

from __future__ import annotations

import glob
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.common.files import atomic_write, leftover_temporaries
from megatron.common.meminfo import available_host_memory
from megatron.config.run import RunConfig
from megatron.pipeline.host_group import host_group
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, OwnedState
from megatron.training.lr_schedule import LRSchedule
from megatron.training.train_step import TrainStep

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA = ".metadata"
FORMAT_VERSION = 1
MiB = 2**20

# One process without torch.distributed is the tools' and a test's case, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


class CheckpointError(ValueError):
    """A checkpoint or its tracker is missing, unreadable or does not fit this run."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker under `root` names, or None when there is no tracker."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def _rng_key(rank: int) -> str:
    return f"rng_state.rank_{rank}"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- saving ------------------------------------------------------------------------------


class CheckpointSaver:
    """Saves under `root`; with `async_save` the write runs in a background thread and
    save() returns after the snapshot. Collective: every rank makes one and calls save()
    at the same iterations. close() waits for the last write."""

    def __init__(self, root: str, *, async_save: bool = True,
                 log: Callable[[str], Any] = print) -> None:
        self.root = root
        self.async_save = async_save
        self.log = log
        self.rank, self.world_size = _world()
        # The writer's collectives must not interleave with training's on the host group.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._buffers: dict[str, torch.Tensor] | None = None  # the async snapshot
        self._error: BaseException | None = None

    def save(self, iteration: int, owned: OwnedState, common: dict) -> float:
        """Save `owned` (this rank's tensors) and `common` (rank 0's) as iteration
        `iteration`. Returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        os.makedirs(self.root, exist_ok=True)
        if self.rank == 0:
            for stale in glob.glob(os.path.join(glob.escape(self.root), "iter_*.tmp")):
                shutil.rmtree(stale, ignore_errors=True)  # of a save killed mid-write
        tensors = dict(owned.tensors)
        tensors[_rng_key(self.rank)] = torch.get_rng_state()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        _check_free_disk(self.root, nbytes)
        snapshot = self._snapshot(tensors, nbytes) if self.async_save else None
        common = {**common, "iteration": iteration, "format_version": FORMAT_VERSION,
                  "world_size": self.world_size, "optimizer_step": owned.optimizer_step,
                  "loss_scaler": owned.loss_scaler, "speculation": owned.speculation}
        if snapshot is not None:
            self._thread = threading.Thread(target=self._write_catching,
                                            args=(iteration, snapshot, common),
                                            name=f"checkpoint-writer-{iteration}", daemon=True)
            self._thread.start()
        else:
            self._write(iteration, tensors, common)
        return time.perf_counter() - t0

    def _snapshot(self, tensors: dict[str, torch.Tensor], nbytes: int
                  ) -> dict[str, torch.Tensor] | None:
        """Copy `tensors` into buffers kept from save to save (allocated once: no page
        faults on the next saves; the previous write is done, so they are free). None
        when the host lacks the memory: this save then runs synchronously."""
        fits = self._buffers is not None and self._buffers.keys() == tensors.keys() and all(
            self._buffers[k].shape == v.shape for k, v in tensors.items())
        if not fits:
            self._buffers = None
            available = available_host_memory()
            if available is not None and nbytes > available:
                self.log(f"checkpoint: the snapshot needs {nbytes / MiB:.0f} MiB of host "
                         f"memory, {available / MiB:.0f} MiB available: saving synchronously")
                return None
            self._buffers = {k: torch.empty_like(v) for k, v in tensors.items()}
        for key, tensor in tensors.items():
            self._buffers[key].copy_(tensor)
        return self._buffers

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"--save {self.root}: writing the checkpoint failed "
                                  f"({error})") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._buffers = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def _write_catching(self, iteration: int, tensors: dict, common: dict) -> None:
        try:
            self._write(iteration, tensors, common)
        except BaseException as exc:  # re-raised by wait() on the training thread
            self._error = exc

    def _write(self, iteration: int, tensors: dict[str, torch.Tensor], common: dict) -> None:
        staging = iteration_dir(self.root, iteration) + ".tmp"
        t0 = time.perf_counter()
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging),
                 process_group=self._group, no_dist=self._group is None)
        seconds = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"checkpoint iteration {iteration}: rank {self.rank} wrote its shard, "
              f"{len(tensors)} tensors, {nbytes / MiB:.1f} MiB in {seconds:.2f} s "
              f"({nbytes / MiB / max(seconds, 1e-9):.1f} MiB/s)", flush=True)
        if self.rank == 0:  # dcp.save returned: every rank's shard and the index are written
            _commit(self.root, iteration, staging, common)
            self.log(f"committed checkpoint {iteration_dir(self.root, iteration)}")


def _commit(root: str, iteration: int, staging: str, common: dict) -> None:
    """Rank 0, once every shard is written: common.pt, the rename, then the tracker."""
    final = iteration_dir(root, iteration)
    torch.save(common, os.path.join(staging, COMMON))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    tracker = os.path.join(root, TRACKER)
    for stale in leftover_temporaries(tracker):  # of a save killed mid-write
        os.unlink(stale)
    payload = str(iteration).encode()
    atomic_write(tracker, lambda stream: stream.write(payload))


def _check_free_disk(root: str, own_bytes: int) -> None:
    """Every rank checks the job's total against its free space (ranks may share a disk);
    all ranks raise together when one lacks space, before anything is written."""
    rank, world = _world()
    total = torch.tensor([float(own_bytes)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total, group=host_group())
    need, free = int(total.item()), shutil.disk_usage(root).free
    short = torch.tensor([1.0 if need > free else 0.0])
    if world > 1:
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=host_group())
    if short.item() > 0:
        where = f"{free / MiB:.1f} MiB free" if need > free else "less free on another rank"
        raise CheckpointError(f"--save {root}: the checkpoint needs {need / MiB:.1f} MiB, "
                              f"{where}")


# --- loading -----------------------------------------------------------------------------


def checkpoint_metadata(directory: str):
    """The DCP index of one iteration directory; refuses the old per-rank format."""
    if glob.glob(os.path.join(glob.escape(directory), "rank_*.pt")):
        raise CheckpointError(f"{directory}: a checkpoint in the old per-rank format "
                              "(rank_NNN.pt); expected the layout-free format (a .metadata "
                              "file): resume it with the version that wrote it")
    if not os.path.exists(os.path.join(directory, METADATA)):
        raise CheckpointError(f"{directory}: no {METADATA}; expected a checkpoint written by "
                              "--save or tools/convert_checkpoint.py")
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{directory}/{METADATA}: unreadable ({exc})") from None


def read_common(directory: str) -> dict:
    path = os.path.join(directory, COMMON)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None


def load_tensors(directory: str, wanted: dict[str, torch.Tensor],
                 process_group: dist.ProcessGroup | None = None) -> None:
    """Fill `wanted` (key -> tensor of the saved shape, any float dtype) in place from
    `directory`. Collective when torch.distributed is initialized."""
    metadata = checkpoint_metadata(directory).state_dict_metadata
    for key, tensor in wanted.items():
        if key not in metadata:
            raise CheckpointError(f"{directory}: has no tensor {key!r} (a checkpoint of "
                                  "another model?)")
        saved = tuple(getattr(metadata[key], "size", ()))
        if saved != tuple(tensor.shape):
            raise CheckpointError(f"{directory}: {key} has shape {list(saved)}, this run's "
                                  f"model expects {list(tensor.shape)}")
    # A state saved in another precision (--optimizer-state-dtype / --master-dtype changed
    # between runs) is read as saved, then converted once: fp32 -> bf16 rounds to nearest
    # even, bf16 -> fp32 widens exactly.
    as_saved = {key: torch.empty(tensor.shape, dtype=metadata[key].properties.dtype)
                if metadata[key].properties.dtype != tensor.dtype else tensor
                for key, tensor in wanted.items()}
    t0 = time.perf_counter()
    dcp.load(as_saved, storage_reader=dcp.FileSystemReader(directory),
             process_group=process_group, no_dist=not dist.is_initialized())
    for key, tensor in wanted.items():
        if as_saved[key] is not tensor:
            tensor.copy_(as_saved[key])
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in wanted.values())
    rank, _ = _world()
    print(f"checkpoint {directory}: rank {rank} read {len(wanted)} tensors, "
          f"{nbytes / MiB:.1f} MiB in {seconds:.2f} s "
          f"({nbytes / MiB / max(seconds, 1e-9):.1f} MiB/s)", flush=True)


def read_all_tensors(directory: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (one process: tools and tests)."""
    metadata = checkpoint_metadata(directory).state_dict_metadata
    wanted = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
              for k, m in metadata.items() if k.startswith(prefix) and hasattr(m, "size")}
    if wanted:
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return wanted


def inspect_checkpoint(root: str, finetune: bool = False) -> tuple[str, dict, dict] | None:
    """(iteration directory, tensor index, common state) of the latest checkpoint under
    `root`, or None when there is none; CheckpointError when it cannot be loaded."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    directory = iteration_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{os.path.join(root, TRACKER)}: names iteration {iteration}, "
                              f"but {directory} is missing")
    metadata = checkpoint_metadata(directory).state_dict_metadata
    common = read_common(directory)
    if not finetune and not any(k.startswith((EXP_AVG, EXP_AVG_SQ)) for k in metadata):
        raise CheckpointError(f"{directory}: holds weights only (no optimizer state, e.g. a "
                              "converted checkpoint); expected --finetune to start from it")
    return directory, metadata, common


def check_resumable(run: RunConfig) -> dict | None:
    """--load's checkpoint, checked before anything is built: readable, the right kind for
    --finetune, and saved with this run's --global-batch-size (the data position). Returns
    its common state (None when --load holds no checkpoint)."""
    c, batch = run.checkpointing, run.training.global_batch_size
    found = inspect_checkpoint(c.load, c.finetune)
    if found is None or c.finetune:
        return None if found is None else found[2]
    common = found[2]
    iteration = int(common["iteration"])
    consumed = int(common.get("consumed_samples", iteration * batch))
    if consumed != iteration * batch:
        raise CheckpointError(f"--load {c.load}: saved after {consumed} samples in "
                              f"{iteration} iterations; expected --global-batch-size "
                              f"{consumed // max(iteration, 1)} (not {batch}) "
                              "to continue at the same sample")
    return common


def load_checkpoint(root: str, owned: OwnedState, *, finetune: bool = False) -> dict | None:
    """Fill this rank's `owned` tensors in place from the latest checkpoint under `root`
    and return its common state (None when `root` holds no checkpoint). With `finetune`
    only the masters are read and the moments are zeroed. Collective."""
    found = inspect_checkpoint(root, finetune)
    if found is None:
        return None
    directory, metadata, common = found
    rank, world = _world()
    wanted = {k: v for k, v in owned.tensors.items() if not finetune or k.startswith(MASTER)}
    rng = _rng_key(rank)
    if common.get("world_size") == world and rng in metadata and not finetune:
        wanted[rng] = torch.get_rng_state()  # per-rank streams mean nothing on another shape
    load_tensors(directory, wanted, host_group() if world > 1 else None)
    if rng in wanted:
        torch.set_rng_state(wanted[rng])
    if finetune:
        for key, tensor in owned.tensors.items():
            if not key.startswith(MASTER):
                tensor.zero_()
    return common


def restore_run(common: dict, step: TrainStep, schedule: LRSchedule,
                finetune: bool) -> tuple[int, int]:
    """After check_resumable() and load_checkpoint(): hand the scalars to the step and the
    LR schedule. Returns (the iteration to continue after, skipped iterations so far);
    (0, 0) with --finetune."""
    if finetune:
        step.restored(0, None, 0)
        return 0, 0
    iteration = int(common["iteration"])
    step.restored(int(common["optimizer_step"]), common.get("loss_scaler"), iteration,
                  common.get("speculation"))
    schedule.load_state_dict(common["lr_schedule"])
    return iteration, int(common.get("skipped_total", 0))
