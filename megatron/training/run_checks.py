"""Bad input that needs the file system or a checkpoint, checked before training starts:
output paths that cannot be written, a --load directory that does not exist, model flags
that differ from the checkpoint's. Each is one line naming the flag, the value and what was
expected (ConfigError, exit status 2), raised before anything is allocated or written.
"""

from __future__ import annotations

import os
import shutil

from megatron.common.units import format_bytes
from megatron.config.errors import ConfigError, flag_name
from megatron.config.model import MODEL_FIELDS
from megatron.config.run import RunConfig

OUTPUT_FILE_FIELDS = ("metrics_file", "timeline", "trace")


def check_output_paths(run: RunConfig) -> None:
    """Every file or directory the run will write is writable now (creating nothing)."""
    if run.checkpointing.save:
        check_writable_dir("--save", run.checkpointing.save)
    if run.logging.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", run.logging.tensorboard_dir)
    for field in OUTPUT_FILE_FIELDS:
        path = getattr(run.logging, field)
        if path:
            check_writable_file(flag_name(field), path)


def check_writable_dir(flag: str, path: str) -> None:
    """`path` is a writable directory, or can be created as one: proven by a probe file in
    it or in its nearest existing ancestor, removed at once. Nothing is created: a run that
    stops on a later check leaves no empty directory (the writers create it when they
    first write)."""
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(flag, path, f"expected a writable directory ({existing} is a file)")
    probe = os.path.join(existing, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(flag, path, f"expected a writable directory ({exc.strerror})") from None


def nearest_existing(path: str) -> str:
    """`path` itself when it exists, else its nearest ancestor that does."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_save_space(run: RunConfig, vocab_size: int | None) -> None:
    """The file system of --save can hold one checkpoint (fp32 masters and Adam's moments
    of every parameter), checked at start instead of at the first save, after training
    ran. `vocab_size`: the vocabulary when known, else a lower bound is checked."""
    save = run.checkpointing.save
    if not save:
        return
    params = run.model.parameters(vocab_size or 1).total
    need = params * run.precision.optimizer_bytes_per_param
    free = shutil.disk_usage(nearest_existing(save)).free
    if need > free:
        raise ConfigError("--save", save, f"a checkpoint of this model needs at least "
                                          f"{format_bytes(need)}, its file system has "
                                          f"{format_bytes(free)} free")


def check_nvme_space(run: RunConfig, vocab_size: int | None) -> None:
    """--optimizer-nvme-path can hold the optimizer state files: twice the states (the
    committed and the staged version) of every parameter, whose processes share a node's
    drive (checked at start for the whole model: the worst case of one node)."""
    c = run.cpu_optimizer
    if c.optimizer_state_location != "nvme" or c.optimizer_nvme_path is None:
        return
    params = run.model.parameters(vocab_size or 1).total
    need = 2 * params * run.precision.optimizer_bytes_per_param
    free = shutil.disk_usage(c.optimizer_nvme_path).free
    if need > free:
        raise ConfigError("--optimizer-nvme-path", c.optimizer_nvme_path,
                          f"room for twice the optimizer states, {format_bytes(need)}; its "
                          f"file system has {format_bytes(free)} free")


def check_writable_file(flag: str, path: str) -> None:
    """`path` can be created or appended to: not a directory, its directory writable."""
    if os.path.isdir(path):
        raise ConfigError(flag, path, "expected a file path, found a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(flag, path, "expected a writable file (permission denied)")
    try:
        check_writable_dir(flag, os.path.dirname(os.path.abspath(path)))
    except ConfigError as exc:
        raise ConfigError(flag, path, f"its directory is not writable ({exc.expected})") from None


def is_auto_resume(run: RunConfig) -> bool:
    """--save D --load D: the idiom of Megatron's launch scripts (resume if D holds a
    checkpoint, else start from scratch)."""
    c = run.checkpointing
    return bool(c.load and c.save) and os.path.abspath(c.load) == os.path.abspath(c.save)


def check_load_dir(run: RunConfig) -> None:
    """--load of a directory that does not exist is a mistake (a typo would silently train
    from scratch), unless it is the --save directory (auto-resume) or --load-optional asks
    for Megatron's behaviour; --exit-on-missing-checkpoint makes it an error always."""
    c = run.checkpointing
    if not c.load or os.path.isdir(c.load):
        return
    if c.exit_on_missing_checkpoint:
        raise ConfigError("--load", c.load, "expected an existing checkpoint directory "
                          "(--exit-on-missing-checkpoint)")
    if not c.load_optional and not is_auto_resume(run):
        raise ConfigError("--load", c.load,
                          "expected an existing checkpoint directory (add --load-optional "
                          "to start from scratch when it does not exist)")


# What a resumed run must also keep to compute what was trained (a fine-tuning run may
# change them: a longer context's rotary base, say).
RESUMED_ARCHITECTURE = ("kv_channels", "rotary_base", "rotary_percent", "norm_epsilon")


def check_checkpoint_model(run: RunConfig, saved: dict | None, where: str) -> None:
    """The model flags of this run equal those the checkpoint in `where` was saved with
    (`saved`: the flags it recorded, RunConfig.flags())."""
    fields = MODEL_FIELDS + (() if run.checkpointing.finetune else RESUMED_ARCHITECTURE)
    for field in fields:
        theirs, ours = (saved or {}).get(field), getattr(run.model, field)
        if theirs is not None and ours is not None and theirs != ours:
            raise ConfigError(flag_name(field), ours,
                              f"the checkpoint in {where} was saved with {theirs}")
