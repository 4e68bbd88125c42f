"""Checkpoints in megatron-core's `torch_dist` format and Megatron's directory convention,
written without stopping.

    DIR/latest_checkpointed_iteration.txt      the tracker (written last)
    DIR/iter_NNNNNNN/metadata.json             megatron-core's format marker (torch_dist)
    DIR/iter_NNNNNNN/.metadata                 torch.distributed.checkpoint's index
    DIR/iter_NNNNNNN/__R_0.distcp              the tensors rank R owned when saving
    DIR/iter_NNNNNNN/common.pt                 iteration, LR schedule, data position, ...

megatron-core 0.19 keeps that common state inside the torch_dist files instead (one object
under the key `common_state`) and writes no common.pt; it still reads a common.pt first when
there is one. So a checkpoint of ours carries both (0.16 to 0.18 read common.pt, releases
that drop it read `common_state`), and a load reads whichever it finds.

Every tensor is a chunk of a global tensor under megatron-core's key, at the offset
`GPTModel.sharded_state_dict()` gives it (checkpoint_layout: stacked decoder layers), so
megatron-core's `dist_checkpointing.load` opens the model, and any process of any pipeline
shape reads the chunks it owns now: resuming on another number of processes, schedule or
backward split needs nothing else. The optimizer state sits beside the model under
megatron-core's optimizer keys (`optimizer.state.exp_avg.KEY`), which a load of the model
alone ignores.

A save is collective. In the foreground every rank waits for its previous save, checks the
free disk space and copies the tensors it owns (the snapshot: host memory to host memory);
a background thread then writes them with torch.distributed.checkpoint over a gloo group
of its own, and rank 0 commits: `iter_N.tmp` is renamed to `iter_N`, then the tracker is
replaced. A crash before that leaves the previous checkpoint and tracker untouched.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron.common.files import atomic_write, leftover_temporaries
from megatron.common.meminfo import available_host_memory
from megatron.config.model import MODEL_FIELDS
from megatron.config.run import RunConfig
from megatron.models.llama import LlamaConfig
from megatron.pipeline.host_group import gloo_group, host_group
from megatron.training import checkpoint_layout as layout
from megatron.training.checkpoint_format import (
    CHECKSUMS,
    FP32_MASTER_KEY,
    OPTIMIZER_KEYS,
    CheckpointError,
    file_checksum,
    load_common_state,
    megatron_common,
    owned_key,
    saved_args,
    scheduler_units,
    sharded_state,
    sharded_tensors,
    split_key,
    verify_checkpoint,
)
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, OwnedState
from megatron.training.lr_schedule import LRSchedule
from megatron.training.train_step import TrainStep

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
COMMON_STATE = "common_state"  # megatron-core 0.19's key of the common state in the DCP files
METADATA = ".metadata"
MCORE_CONFIG = "metadata.json"  # megatron-core's marker of a distributed checkpoint
# 1: plain DCP with `model.NAME` keys; 2: torch_dist; 3: the LR schedule counts samples
# (all still read)
FORMAT_VERSION = 3
ITERATION_DIR = re.compile(r"iter_(\d{7})$")
MiB = 2**20

# One process without torch.distributed is the tools' and a test's case, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)
# megatron-core stores stacked layers through torch's ShardedTensor (its own format).
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                        "ShardedTensor", category=FutureWarning)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dirs(root: str) -> list[str]:
    """The directories under `root` where a save stages its files (iter_N.tmp, renamed to
    iter_N at its commit): any found between saves are of one that did not finish."""
    return glob.glob(os.path.join(glob.escape(root), "iter_*.tmp"))


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker under `root` names, or None when there is no tracker."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    text = read_tracker(tracker)
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def read_tracker(tracker: str) -> str:
    """The tracker's text; a tracker that is not text is one line naming it."""
    with open(tracker, "rb") as stream:
        data = stream.read()
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{tracker}: expected an iteration number, found bytes that "
                              f"are not text ({data[exc.start:exc.start + 1]!r} at byte "
                              f"{exc.start})") from None


@contextlib.contextmanager
def reading_checkpoint(root: str) -> Iterator[None]:
    """A checkpoint this process may not read (a directory or file without read
    permission) is bad input: one line naming the file, not a traceback."""
    try:
        yield
    except PermissionError as exc:
        raise CheckpointError(f"--load {root}: {exc.filename or root}: permission denied "
                              "(expected a checkpoint this user can read)") from None


def is_iteration_dir(path: str) -> bool:
    """A directory holding one checkpoint (ours, megatron-core's or the old formats)."""
    return any(os.path.exists(os.path.join(path, f)) for f in (MCORE_CONFIG, METADATA)) or \
        bool(glob.glob(os.path.join(glob.escape(path), "rank_*.pt")))


def _complete_iterations(root: str) -> list[int]:
    """The iterations under `root` whose directory holds a committed checkpoint."""
    found = []
    for entry in os.listdir(root) if os.path.isdir(root) else ():
        match = ITERATION_DIR.match(entry)
        path = os.path.join(root, entry)
        # committed: common.pt (ours, megatron-core <= 0.18) or metadata.json, which
        # megatron-core (0.19: no common.pt) writes once every file is in
        complete = os.path.exists(os.path.join(path, COMMON)) or is_mcore_checkpoint(path)
        if match and complete and is_iteration_dir(path):
            found.append(int(match.group(1)))
    return sorted(found)


def find_checkpoint(root: str) -> tuple[str, str | None] | None:
    """(the iteration directory --load means, a line saying how it was chosen when the
    tracker did not say) or None when `root` holds no checkpoint. `root` may be one
    iteration directory (DIR/iter_0000003, or a bare dist_checkpointing.save directory)."""
    if os.path.isdir(root) and is_iteration_dir(root):
        return root, None
    tracker = os.path.join(root, TRACKER)
    release = os.path.join(root, "release")  # Megatron's tracker of a released model
    if (os.path.isdir(release) and os.path.exists(tracker)
            and read_tracker(tracker) == "release"):
        return release, None
    iteration = latest_iteration(root)
    if iteration is not None and os.path.isdir(iteration_dir(root, iteration)):
        return iteration_dir(root, iteration), None
    complete = _complete_iterations(root)
    if iteration is not None and not complete:
        raise CheckpointError(f"{tracker}: names iteration {iteration}, but "
                              f"{iteration_dir(root, iteration)} is missing")
    if not complete:
        return None
    why = (f"{TRACKER} is missing" if iteration is None
           else f"{TRACKER} names iteration {iteration}, whose directory is missing")
    return (iteration_dir(root, complete[-1]),
            f"{root}: {why}; loading the newest complete iteration, {complete[-1]}")


def _rng_key(rank: int) -> str:
    return f"rng_state.rank_{rank}"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- saving ------------------------------------------------------------------------------


def first_line(exc: BaseException) -> str:
    """An error's message on one line (dcp's CheckpointException lists every rank's)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]  # (exception, traceback) per rank
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class CheckpointWriteError(CheckpointError):
    """A save failed mid-run (a full disk, say): a fault, not bad input (exit status 1);
    the previous checkpoint and the tracker are untouched."""


def write_failure(root: str, exc: BaseException) -> CheckpointWriteError:
    """The one line of a failed write. A disk that filled up shows through torch as an
    internal error ('[enforce fail at inline_container.cc] unexpected pos'): say so."""
    reason = first_line(exc)
    full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root).free
        if not full and free < MiB:
            reason = f"No space left on device: {free // 1024} KiB free"
    return CheckpointWriteError(f"--save {root}: writing the checkpoint failed ({reason}); "
                                "the previous checkpoint is intact")


class CheckpointSaver:
    """Saves under `root`; with `async_save` the write runs in a background thread and
    save() returns after the snapshot. Collective: every rank makes one and calls save()
    at the same iterations. close() waits for the last write."""

    def __init__(self, root: str, model: LlamaConfig, *, async_save: bool = True,
                 log: Callable[[str], Any] = print) -> None:
        self.root = root
        self.model = model
        self.async_save = async_save
        self.log = log
        self.rank, self.world_size = _world()
        # The writer's collectives must not interleave with training's on the host group.
        self._group = gloo_group() if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._buffers: dict[str, torch.Tensor] | None = None  # the async snapshot
        self._error: BaseException | None = None

    def save(self, iteration: int, owned: OwnedState, common: dict) -> float:
        """Save `owned` (this rank's tensors) and `common` (rank 0's) as iteration
        `iteration`. Returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"--save {self.root}: cannot be created ({exc.strerror})"
                                  ) from None
        if self.rank == 0:
            for stale in staging_dirs(self.root):
                shutil.rmtree(stale, ignore_errors=True)  # of a save killed mid-write
        try:  # in the foreground: a name megatron-core's GPTModel lacks is the caller's bug
            layout.layout_of(self.model, {split_key(k)[1] for k in owned.tensors})
        except KeyError as exc:
            raise CheckpointError(f"--save {self.root}: {exc.args[0]}") from None
        tensors = dict(owned.tensors)
        tensors[_rng_key(self.rank)] = torch.get_rng_state()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        _check_free_disk(self.root, nbytes)
        snapshot = self._snapshot(tensors, nbytes) if self.async_save else None
        common = {**common, "iteration": iteration, "format_version": FORMAT_VERSION,
                  "world_size": self.world_size, "optimizer_step": owned.optimizer_step,
                  "loss_scaler": owned.loss_scaler, "speculation": owned.speculation}
        common = megatron_common(common, iteration)
        if snapshot is not None:
            self._thread = threading.Thread(target=self._write_catching,
                                            args=(iteration, snapshot, common),
                                            name=f"checkpoint-writer-{iteration}", daemon=True)
            self._thread.start()
        else:
            try:
                self._write(iteration, tensors, common)
            except (OSError, CheckpointException, RuntimeError) as exc:
                # RuntimeError: torch.save's zip writer on a full disk ('unexpected pos')
                raise write_failure(self.root, exc) from None
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
            raise write_failure(self.root, error) from error

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
        try:
            self._write_staged(iteration, staging, tensors, common)
        except BaseException:
            # every rank is out of dcp.save (it gathers the ranks' outcomes) or this is the
            # only one: what was staged goes, so that a full disk is not kept full by it
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise

    def _write_staged(self, iteration: int, staging: str, tensors: dict[str, torch.Tensor],
                      common: dict) -> None:
        from megatron.core.dist_checkpointing import ShardedObject
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )

        t0 = time.perf_counter()
        # What megatron-core's TorchDistSaveShardedStrategy does, over our own group (the
        # writer thread's collectives must not meet training's): one copy of what several
        # data-parallel replicas hold (keep_only_main_replica), chunks at their offsets.
        sharded = sharded_state(self.model, tensors)
        # megatron-core 0.19's place of the common state (rank 0's copy is the one kept)
        sharded[COMMON_STATE] = ShardedObject(COMMON_STATE, common, (1,), (0,),
                                              replica_id=self.rank)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded,
                                                                keep_only_main_replica=True)
        dcp.save(mcore_to_pyt_state_dict(flat, False),
                 storage_writer=dcp.FileSystemWriter(staging),
                 planner=MCoreSavePlanner(flatten_state_dict=False),
                 process_group=self._group, no_dist=self._group is None)
        # Each rank sums the files it wrote (the page cache still holds them); rank 0
        # records them all with the others at the commit.
        sums = {os.path.basename(f): file_checksum(f) for f in
                glob.glob(os.path.join(glob.escape(staging), f"__{self.rank}_*.distcp"))}
        if self._group is not None:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, sums, group=self._group)
            sums = {k: v for part in gathered for k, v in part.items()}
        seconds = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        # one write per line (the newline in it): every rank prints this at the same
        # moment, and an unbuffered stdout would otherwise interleave text and newlines
        print(f"checkpoint iteration {iteration}: rank {self.rank} wrote its shard, "
              f"{len(tensors)} tensors, {nbytes / MiB:.1f} MiB in {seconds:.2f} s "
              f"({nbytes / MiB / max(seconds, 1e-9):.1f} MiB/s)\n", end="", flush=True)
        if self.rank == 0:  # dcp.save returned: every rank's shard and the index are written
            _commit(self.root, iteration, staging, common, sums)
            self.log(f"committed checkpoint {iteration_dir(self.root, iteration)}")


def _commit(root: str, iteration: int, staging: str, common: dict,
            shard_sums: dict[str, dict]) -> None:
    """Rank 0, once every shard is written: common.pt, metadata.json, the checksums, the
    rename, then the tracker."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    final = iteration_dir(root, iteration)
    torch.save(common, os.path.join(staging, COMMON))
    save_config(CheckpointingConfig("torch_dist"), staging)
    sums = {**shard_sums, **{f: file_checksum(os.path.join(staging, f))
                             for f in (METADATA, COMMON, MCORE_CONFIG)}}
    with open(os.path.join(staging, CHECKSUMS), "w") as stream:
        json.dump(dict(sorted(sums.items())), stream, indent=1)
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


def is_mcore_checkpoint(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, MCORE_CONFIG))


def checkpoint_metadata(directory: str):
    """The DCP index of one iteration directory; refuses the old per-rank format and
    megatron-core backends other than torch_dist."""
    if glob.glob(os.path.join(glob.escape(directory), "rank_*.pt")):
        raise CheckpointError(f"{directory}: a checkpoint in the old per-rank format "
                              "(rank_NNN.pt); expected the layout-free format (a .metadata "
                              "file): resume it with the version that wrote it")
    if is_mcore_checkpoint(directory):
        try:
            with open(os.path.join(directory, MCORE_CONFIG)) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{directory}/{MCORE_CONFIG}: unreadable ({exc})") from None
        if backend != "torch_dist":
            raise CheckpointError(f"{directory}: a megatron-core checkpoint with sharded "
                                  f"backend {backend!r}; expected 'torch_dist' (convert it "
                                  "with Megatron-LM's tools first)")
    if not os.path.exists(os.path.join(directory, METADATA)):
        raise CheckpointError(f"{directory}: no {METADATA}; expected a checkpoint written by "
                              "--save, megatron-core or tools/convert_checkpoint.py")
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{directory}/{METADATA}: unreadable ({exc})") from None


def read_common(directory: str) -> dict:
    """The common state: common.pt where there is one (ours; megatron-core up to 0.18, and
    0.19 reads it first too), else megatron-core 0.19's `common_state` object inside the
    torch_dist files; empty when there is neither (a dist_checkpointing.save of a model
    alone)."""
    path = os.path.join(directory, COMMON)
    if not os.path.exists(path) and is_mcore_checkpoint(directory):
        return _read_common_state(directory)
    try:
        return load_common_state(path)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None


def _read_common_state(directory: str) -> dict:
    """megatron-core 0.19's common state: a ShardedObject `common_state` of one shard, the
    torch.save bytes of a one-element list ([state]); {} when the checkpoint has none."""
    metadata = checkpoint_metadata(directory).state_dict_metadata
    keys = [k for k in metadata if k.split("/")[0] == COMMON_STATE]
    if not keys:
        return {}
    planner = _RawBytesPlanner(flatten_state_dict=False)
    try:
        dcp.load({keys[0]: None}, storage_reader=dcp.FileSystemReader(directory),
                 planner=planner, no_dist=True)
        loaded = load_common_state(io.BytesIO(planner.objects[keys[0]]))
    except Exception as exc:
        raise CheckpointError(f"{directory}: its {COMMON_STATE} (megatron-core 0.19's "
                              f"common state) is unreadable ({first_line(exc)})") from None
    state = loaded[0] if isinstance(loaded, list) and loaded else loaded
    if not isinstance(state, dict):
        raise CheckpointError(f"{directory}: its {COMMON_STATE} holds a "
                              f"{type(state).__name__}; expected megatron-core's common "
                              "state (a dict)")
    return state


class _RawBytesPlanner(dcp.DefaultLoadPlanner):
    """Hands over a stored object's bytes as they are (the default planner unpickles them
    itself, and fails on a class this program lacks)."""

    objects: dict[str, bytes]

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.objects = {**getattr(self, "objects", {}), read_item.dest_index.fqn:
                        value.getvalue()}


def load_tensors(directory: str, wanted: dict[str, torch.Tensor],
                 process_group: dist.ProcessGroup | None = None,
                 model: LlamaConfig | None = None) -> None:
    """Fill `wanted` (OwnedState key -> tensor of the model's shape, any float dtype) in
    place from `directory`. A tensor saved in another precision (--master-dtype /
    --optimizer-state-dtype changed between runs) is converted once: fp32 -> bf16 rounds
    to nearest even, bf16 -> fp32 widens exactly. Collective when torch.distributed is
    initialized."""
    metadata = checkpoint_metadata(directory).state_dict_metadata
    t0 = time.perf_counter()
    try:
        if is_mcore_checkpoint(directory):
            _load_mcore(directory, wanted, metadata, process_group, model)
        else:
            _load_format_1(directory, wanted, metadata, process_group)
    except (EOFError, CheckpointException, OSError) as exc:
        if isinstance(exc, PermissionError):
            raise
        # a shard cut short (megatron-core's checkpoints have no checksums to tell it
        # before): one line, on every rank (dcp hands every rank the failure)
        why = first_line(exc)
        why = "a file ends early: truncated" if why in ("EOFError", "") else why
        raise CheckpointError(f"{directory}: its tensors cannot be read ({why})") from None
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in wanted.values())
    rank, _ = _world()
    print(f"checkpoint {directory}: rank {rank} read {len(wanted)} tensors, "
          f"{nbytes / MiB:.1f} MiB in {seconds:.2f} s "
          f"({nbytes / MiB / max(seconds, 1e-9):.1f} MiB/s)", flush=True)


def _load_mcore(directory: str, wanted: dict[str, torch.Tensor], metadata,
                process_group: dist.ProcessGroup | None, model: LlamaConfig) -> None:
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    fp32 = any(k.startswith(FP32_MASTER_KEY + ".") for k in metadata)
    sharded = {k: v for k, v in sharded_state(model, wanted, fp32_masters=fp32).items()
               if not isinstance(v, ShardedObject)}  # the (empty) extra state: not read
    tensors = sharded_tensors(sharded)
    for sh in tensors:
        if sh.key not in metadata:
            raise CheckpointError(f"{directory}: has no tensor {sh.key!r} (a checkpoint of "
                                  "another model?)")
        saved = tuple(getattr(metadata[sh.key], "size", ()))
        if saved != tuple(sh.global_shape):
            raise CheckpointError(f"{directory}: {sh.key} has shape {list(saved)}, this run's "
                                  f"model expects {list(sh.global_shape)}")
    # megatron-core's TorchDistLoadShardedStrategy.load, over our group: every chunk lands
    # in place, in the views of `wanted` the factories and ShardedTensors hold.
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded)
    dcp.load(mcore_to_pyt_state_dict(flat, True),
             storage_reader=dcp.FileSystemReader(directory),
             planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=tensors),
             process_group=process_group, no_dist=not dist.is_initialized())


def _load_format_1(directory: str, wanted: dict[str, torch.Tensor], metadata,
                   process_group: dist.ProcessGroup | None) -> None:
    """This project's first format: plain DCP, every tensor whole under its OwnedState key."""
    for key, tensor in wanted.items():
        if key not in metadata:
            raise CheckpointError(f"{directory}: has no tensor {key!r} (a checkpoint of "
                                  "another model?)")
        saved = tuple(getattr(metadata[key], "size", ()))
        if saved != tuple(tensor.shape):
            raise CheckpointError(f"{directory}: {key} has shape {list(saved)}, this run's "
                                  f"model expects {list(tensor.shape)}")
    as_saved = {key: torch.empty(tensor.shape, dtype=metadata[key].properties.dtype)
                if metadata[key].properties.dtype != tensor.dtype else tensor
                for key, tensor in wanted.items()}
    dcp.load(as_saved, storage_reader=dcp.FileSystemReader(directory),
             process_group=process_group, no_dist=not dist.is_initialized())
    for key, tensor in wanted.items():
        if as_saved[key] is not tensor:
            tensor.copy_(as_saved[key])


def read_all_tensors(directory: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under OwnedState key `prefix`, by OwnedState key, whatever format
    holds them (one process, no process group: tools and tests). megatron-core's stacked
    layers are unstacked with the layer spec's own key map, inverted."""
    metadata = checkpoint_metadata(directory).state_dict_metadata
    tensors = {k: m for k, m in metadata.items() if hasattr(m, "size")}
    if not is_mcore_checkpoint(directory):
        wanted = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                  for k, m in tensors.items() if k.startswith(prefix)}
        if wanted:
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
        return wanted
    fp32 = any(k.startswith(FP32_MASTER_KEY + ".") for k in tensors)
    where: dict[str, tuple[str, int | None]] = {}  # OwnedState key -> (stored key, layer)
    for stored, m in tensors.items():
        if stored.startswith("rng_state.") and stored.startswith(prefix):
            where[stored] = (stored, None)
        owned = owned_key(stored, fp32)
        if owned is None:
            continue
        ours, key = owned
        for name, index in layout.unstacked_names(key, m.size[0]):
            if (ours + name).startswith(prefix):
                where[ours + name] = (stored, index)
    whole = {stored: torch.empty(tuple(tensors[stored].size),
                                 dtype=tensors[stored].properties.dtype)
             for stored, _ in where.values()}
    if whole:
        dcp.load(whole, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return {k: whole[stored] if layer is None else whole[stored][layer].clone()
            for k, (stored, layer) in where.items()}


def has_optimizer_state(directory: str, metadata) -> bool:
    if is_mcore_checkpoint(directory):
        return any(k.startswith(OPTIMIZER_KEYS[EXP_AVG] + ".") for k in metadata)
    return any(k.startswith((EXP_AVG, EXP_AVG_SQ)) for k in metadata)


def inspect_checkpoint(root: str, log: Callable[[str], Any] = print
                       ) -> tuple[str, dict, dict] | None:
    """(iteration directory, tensor index, common state) of the checkpoint --load `root`
    means, or None when there is none; CheckpointError when it cannot be loaded."""
    found = find_checkpoint(root)
    if found is None:
        return None
    directory, note = found
    if note:
        log(note)
    metadata = checkpoint_metadata(directory).state_dict_metadata
    return directory, metadata, read_common(directory)


def unresumable(common: dict) -> str:
    """What of the iteration, LR schedule and data position a checkpoint's common state
    lacks ('' when it has all three). Ours count the data position in iterations of
    the global batch, which the args record; Megatron's record the samples consumed; a
    checkpoint at iteration 0 (a converted or released model) has no schedule to resume."""
    if "iteration" not in common:
        return "iteration (no common state: neither common.pt nor megatron-core's " \
               f"{COMMON_STATE})" if not common else "iteration"
    if int(common["iteration"]) == 0:
        return ""
    missing = []
    if not any(k in common for k in ("lr_schedule", "opt_param_scheduler")):
        missing.append("LR scheduler state")
    args = saved_args(common)
    if "consumed_samples" not in common and "consumed_train_samples" not in args and not (
            "format_version" in common and args.get("global_batch_size")):
        missing.append("data position (consumed samples)")
    return " or ".join(missing)


def check_resumable(run: RunConfig, log: Callable[[str], Any] = print) -> dict | None:
    """--load's checkpoint, checked before anything is built: readable, its files as
    saved (checksums; collective), and saved with this run's --global-batch-size (the
    data position). Returns its common state (None
    when --load holds no checkpoint)."""
    c, batch = run.checkpointing, run.training.global_batch_size
    found = inspect_checkpoint(c.load, log)
    if found is None:
        return None
    _, world = _world()
    verify_checkpoint(found[0], host_group() if world > 1 else None)
    if c.finetune:
        return found[2]
    common = found[2]
    recorded = common.get("iteration")
    if recorded is not None and int(recorded) < 0:
        raise CheckpointError(f"--load {c.load}: {found[0]} records iteration {recorded}; "
                              "expected an iteration >= 0 (a damaged checkpoint)")
    missing = unresumable(common)
    if missing:
        raise CheckpointError(f"--load {c.load}: {found[0]} records no {missing}, so training "
                              "cannot continue where it stopped; --finetune starts from its "
                              "weights at iteration 0")
    iteration = int(common["iteration"])
    consumed = int(common.get("consumed_samples",
                              saved_args(common).get("consumed_train_samples",
                                                     iteration * batch)))
    if consumed != iteration * batch:
        raise CheckpointError(f"--load {c.load}: saved after {consumed} samples in "
                              f"{iteration} iterations; expected --global-batch-size "
                              f"{consumed // max(iteration, 1)} (not {batch}) "
                              "to continue at the same sample")
    return common


# Megatron-LM's load_args_from_checkpoint: the forced flags replace the run's, the others
# fill only the flags not given
FORCED_CHECKPOINT_ARGS = ("num_query_groups", "rotary_base", "rotary_percent",
                          "attention_dropout", "hidden_dropout")
# (--make-vocab-size-divisible-by: Megatron-LM takes the checkpoint's padded vocabulary,
# the rows that divisor made of the tokenizer's)
CHECKPOINT_ARGS = (*MODEL_FIELDS, "kv_channels", "max_position_embeddings",
                   "make_vocab_size_divisible_by", *FORCED_CHECKPOINT_ARGS)


def checkpoint_args(load: str) -> dict | None:
    """--use-checkpoint-args: the model flags the checkpoint --load means recorded, by
    argparse name (ours or Megatron-LM's, any version); None when `load` holds none."""
    found = inspect_checkpoint(load, lambda _: None) if os.path.isdir(load) else None
    if found is None:
        return None
    args = saved_args(found[2])
    values = {f: args[f] for f in CHECKPOINT_ARGS if args.get(f) is not None}
    if not values:
        raise CheckpointError(f"--use-checkpoint-args: {found[0]} records no model flags "
                              "(no args in its common state); give the model flags")
    return values


def load_checkpoint(root: str, owned: OwnedState, model: LlamaConfig, *,
                    finetune: bool = False, load_optim: bool = True, load_rng: bool = True,
                    verify: bool = True, log: Callable[[str], Any] = print) -> dict | None:
    """Fill this rank's `owned` tensors in place from the checkpoint `root` means and
    return its common state (None when `root` holds no checkpoint), after checking its
    files against their checksums (`verify`). Without the moments
    (--finetune, --no-load-optim, or a checkpoint without them) they are zeroed and
    common["optimizer_step"] is 0. Collective."""
    found = inspect_checkpoint(root, lambda _: None)  # check_resumable said how it chose
    if found is None:
        return None
    directory, metadata, common = found
    rank, world = _world()
    if verify:
        verify_checkpoint(directory, host_group() if world > 1 else None)
    fresh = finetune or not load_optim or not has_optimizer_state(directory, metadata)
    if fresh and not finetune and load_optim:
        log(f"{directory} holds no optimizer state this run can map: the run starts a fresh "
            "optimizer (as --no-load-optim does)")
    wanted = {k: v for k, v in owned.tensors.items() if not fresh or k.startswith(MASTER)}
    rng = _rng_key(rank)
    if (common.get("world_size") == world and rng in metadata and not finetune and load_rng):
        wanted[rng] = torch.get_rng_state()  # per-rank streams mean nothing on another shape
    load_tensors(directory, wanted, host_group() if world > 1 else None, model)
    if rng in wanted:
        torch.set_rng_state(wanted[rng])
    if fresh:
        for key, tensor in owned.tensors.items():
            if not key.startswith(MASTER):
                tensor.zero_()
        common = {**common, "optimizer_step": 0}
    return common


def restore_run(common: dict, step: TrainStep, schedule: LRSchedule, finetune: bool,
                log: Callable[[str], Any] = print) -> tuple[int, int]:
    """After check_resumable() and load_checkpoint(): hand the scalars to the step and the
    LR schedule. Returns (the iteration to continue after, skipped iterations so far);
    (0, 0) with --finetune. A Megatron checkpoint's scheduler counts samples: its steps
    are divided by the global batch it was saved with. Where the checkpoint's schedule
    differs from this run's flags, one line says which values continue."""
    if finetune:
        step.restored(0, None, 0)
        return 0, 0
    iteration = int(common.get("iteration", 0))
    step.restored(int(common.get("optimizer_step", 0)), common.get("loss_scaler"), iteration,
                  common.get("speculation"))
    state = common.get("lr_schedule")
    if state is not None and common.get("format_version", FORMAT_VERSION) < 3:
        # formats 1 and 2 counted the schedule in iterations; it counts samples since 3
        batch = saved_args(common).get("global_batch_size") or 1
        state = scheduler_units(state, batch)
    if state is None and "opt_param_scheduler" in common:  # Megatron's: samples, as ours
        state = common["opt_param_scheduler"]
    if state is None:
        state = {**schedule.state_dict(),
                 "num_steps": iteration * schedule.samples_per_iteration}
    try:
        kept = schedule.load_state_dict(state)
    except AssertionError as exc:  # OptimizerParamScheduler's check of its flags
        raise CheckpointError(f"the checkpoint's LR schedule differs from this run's: "
                              f"{exc}") from None
    if kept:
        log("the checkpoint's LR schedule continues, where it differs from this run's flags: "
            + ", ".join(kept) + "; --override-opt_param-scheduler takes this run's")
    return iteration, int(common.get("skipped_total", 0))
