"""Bad input that needs the file system or a checkpoint, checked before training starts:
output paths that cannot be written, a --load directory that does not exist, model flags
that differ from the checkpoint's. Each is one line naming the flag, the value and what was
expected (ConfigError, exit status 2), raised before anything is allocated or written.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from megatron.common.units import format_bytes
from megatron.config.errors import ConfigError, flag_name
from megatron.config.model import MODEL_FIELDS
from megatron.config.output_paths import (
    check_writable_dir,
    check_writable_file,
    nearest_existing,
)
from megatron.config.run import ONE_PROCESS_SCHEDULE, RunConfig
from megatron.optimizer.state_io import ALIGNMENT
from megatron.planning.shape import Unbuildable, build_run_schedule
from megatron.schedules.generators import DEFAULT_SCHEDULE
from megatron.training.checkpoint_format import foreign_architecture, saved_args
from megatron.training.checkpointing import staging_dirs

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


def checkpoint_bytes(run: RunConfig, vocab_size: int | None) -> int:
    """The bytes of one checkpoint: the master and Adam's two moments of every parameter
    (embeddings and output layer of `vocab_size` rows included), each in the precision the
    run keeps it in, and megatron-core's index and common state (bounded by 1 MiB)."""
    params = run.model.parameters(vocab_size or 1).total
    return params * run.precision.optimizer_bytes_per_param + 2**20


def staged_bytes(save: str) -> int:
    """The bytes of the staging directories (iter_N.tmp) under `save` that a save which
    did not finish left."""
    total = 0
    for staging in staging_dirs(save):
        for folder, _, files in os.walk(staging):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def check_save_space(run: RunConfig, vocab_size: int | None) -> None:
    """The file system of --save can hold one checkpoint (checkpoint_bytes), checked at
    start instead of at the first save, after training ran. `vocab_size`: the padded
    vocabulary when known (checked again once the tokenizer gives it), else a lower bound
    is checked."""
    save = run.checkpointing.save
    if not save:
        return
    need = checkpoint_bytes(run, vocab_size)
    # what a save killed mid-write staged there is removed by the first save, before it
    # writes: it counts as free
    free = shutil.disk_usage(nearest_existing(save)).free + staged_bytes(save)
    if need > free:
        raise ConfigError("--save", save, f"a checkpoint of this model needs at least "
                                          f"{format_bytes(need)}, its file system has "
                                          f"{format_bytes(free)} free")


def state_file_bytes(run: RunConfig, vocab_size: int | None) -> int:
    """What the optimizer state files of one node take at most (disk_states.file_bytes):
    both versions (committed, staged) of every parameter's states, as many copies as
    data-parallel replicas without ZeRO keep, each group's three parts padded to the I/O
    alignment (a group per backward stage and class: at most two per layer, embedding and
    output layer)."""
    params = run.model.parameters(vocab_size or 1).total
    copies = run.data_parallel_size if run.parallel.zero_stage == 0 else 1
    groups = 2 * (run.model.num_layers + 2) * copies
    return 2 * (copies * params * run.precision.optimizer_bytes_per_param
                + groups * 3 * ALIGNMENT)


def check_nvme_space(run: RunConfig, vocab_size: int | None) -> None:
    """--optimizer-nvme-path can hold the optimizer state files (state_file_bytes, for the
    whole model: the worst case of one node, whose processes share its drive)."""
    path = run.cpu_optimizer.placement.states.nvme_path
    if path is None:  # in host memory, or a plan
        return
    need = state_file_bytes(run, vocab_size)
    free = shutil.disk_usage(path).free
    if need > free:
        raise ConfigError("--optimizer-nvme-path", path,
                          f"room for twice the optimizer states, {format_bytes(need)}; its "
                          f"file system has {format_bytes(free)} free")


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
    if os.path.lexists(c.load):  # a file (or a link to nothing) is a mistake, optional or not
        raise ConfigError("--load", c.load, "expected a checkpoint directory, found "
                          + ("a file" if os.path.exists(c.load) else "a broken link"))
    if c.exit_on_missing_checkpoint:
        raise ConfigError("--load", c.load, "expected an existing checkpoint directory "
                          "(--exit-on-missing-checkpoint)")
    if not c.load_optional and not is_auto_resume(run):
        raise ConfigError("--load", c.load,
                          "expected an existing checkpoint directory (add --load-optional "
                          "to start from scratch when it does not exist)")


# The model flags that shape the checkpoint's weights: all but the sequence length (rotary
# positions have no weight), so a run may go on at another length, as with Megatron-LM (a
# longer context).
WEIGHT_SHAPE_FIELDS = tuple(field for field in MODEL_FIELDS if field != "seq_length")
# What a resumed run must also keep to compute what was trained (a fine-tuning run may
# change them: a longer context's rotary base, say).
RESUMED_ARCHITECTURE = ("kv_channels", "rotary_base", "rotary_percent", "norm_epsilon")


def check_checkpoint_model(run: RunConfig, saved: dict | None, where: str,
                           saved_vocab_rows: int | None = None) -> None:
    """The model flags of this run equal those the checkpoint in `where` was saved with
    (`saved`: the flags it recorded, RunConfig.flags()); before the data, so the
    vocabulary is compared where --vocab-size gives it (`saved_vocab_rows`: the padded
    vocabulary the checkpoint recorded; check_checkpoint_vocabulary again with the
    tokenizer's)."""
    saved = saved or {}
    foreign = foreign_architecture(saved)
    if foreign:
        raise ConfigError("--load", where, f"the checkpoint was saved with {foreign}")
    fields = WEIGHT_SHAPE_FIELDS + (() if run.checkpointing.finetune
                                    else RESUMED_ARCHITECTURE)
    for field in fields:
        theirs, ours = saved.get(field), getattr(run.model, field)
        if field == "kv_channels" and saved.get("hidden_size") and saved.get(
                "num_attention_heads"):  # the head width, given or implied
            theirs = theirs or saved["hidden_size"] // saved["num_attention_heads"]
            ours = run.model.head_dim
        if theirs is not None and ours is not None and theirs != ours:
            raise ConfigError(flag_name(field), ours,
                              f"the checkpoint in {where} was saved with {theirs}")
    check_checkpoint_vocabulary(run, saved, where, saved_vocab_rows)


def check_checkpoint_vocabulary(run: RunConfig, saved: dict | None, where: str,
                                saved_vocab_rows: int | None,
                                vocab_rows: int | None = None) -> None:
    """The embedding's and output layer's rows (the vocabulary padded to a multiple of
    --make-vocab-size-divisible-by, as Megatron pads it) equal the checkpoint's, named by
    the flag that decides them. `vocab_rows`: this run's, once the tokenizer gave them;
    None: from --vocab-size, when given (before the data)."""
    m = run.model
    if saved_vocab_rows is None:
        return
    given = run.vocab_size_given
    if vocab_rows is None:
        if given is None or run.data.tokenizer_type == "NullTokenizer":
            return  # the tokenizer decides: checked again after the data
        vocab_rows = m.padded_vocab_size(given)
    if vocab_rows == saved_vocab_rows:
        return
    divisor = m.make_vocab_size_divisible_by
    theirs = (f"the checkpoint in {where} has {saved_vocab_rows} (its embedding and output "
              "layer rows)")
    saved_divisor = (saved or {}).get("make_vocab_size_divisible_by")
    if saved_divisor not in (None, divisor):
        raise ConfigError("--make-vocab-size-divisible-by", divisor,
                          f"the vocabulary pads to {vocab_rows} rows; {theirs}, padded to a "
                          f"multiple of {saved_divisor}")
    pads = f"pads to {vocab_rows} rows (a multiple of --make-vocab-size-divisible-by {divisor})"
    if given is not None:
        raise ConfigError("--vocab-size", given, f"{pads}; {theirs}")
    d = run.data
    flag, value = (("--tokenizer-model", d.tokenizer_model) if d.tokenizer_model
                   else ("--tokenizer-type", d.tokenizer_type or "the demo corpus's"))
    # --vocab-size widens only this project's tokenizer JSON (Megatron's types ignore it)
    hint = " (give --vocab-size to pad to its rows)" if d.tokenizer_type is None else ""
    raise ConfigError(flag, value, f"its vocabulary {pads}; {theirs}: the checkpoint of "
                      f"another tokenizer{hint}")


def check_schedule_size(run: RunConfig, pipeline_size: int) -> None:
    """The schedule the run asks for on `pipeline_size` ranks can be built: its size
    (stages x micro-batches x (1 + backward split) FORWARD/BACKWARD instructions, bounded by
    MAX_COMPUTE_INSTRUCTIONS) and its shape follow from the flags alone, with no vocabulary,
    so this runs before the data phase writes anything (a --global-batch-size of 40
    million would otherwise build gigabytes of index files first). A --schedule-file's
    programs are read, not built: check_pipeline_shape reads and checks it."""
    if run.parallel.schedule_file is not None:
        return
    shape = build_run_schedule(run, pipeline_size, vocab_size=1, lower=False)
    if isinstance(shape, Unbuildable):
        raise shape.error()


# What a resume may change and still continue at the same sample: the iteration's sums (of
# micro-batches' gradients, of the norm's squares) then run in another order, so it
# continues within rounding of the run that saved it, not bit for bit.
RESUME_SHAPE_FLAGS = ("micro_batch_size", "pipeline_schedule", "forward_stages",
                      "backward_split", "stage_layers", "data_parallel_size")


def resume_shape_notice(run: RunConfig, common: dict, world_size: int, where: str
                        ) -> str | None:
    """One line when this run resumes the checkpoint in `where` (its common state
    `common`, saved by this program) with another shape than it was saved with: another
    --micro-batch-size, schedule, stage split or number of processes; None when it
    continues bit for bit (or starts over: --finetune)."""
    if run.checkpointing.finetune or "format_version" not in common:
        return None  # fine-tuning starts over; another program's run is not continued
    theirs, ours = saved_args(common), run.flags()
    saved_world = common.get("world_size")
    changes = []
    if saved_world not in (None, world_size):
        changes.append(f"{world_size} process(es) (saved on {saved_world})")
    for field in RESUME_SHAPE_FLAGS:
        saved, now = theirs.get(field), ours.get(field)
        if field == "pipeline_schedule":  # None: the one each side ran by default
            saved = saved or _default_schedule(saved_world or world_size)
            now = now or _default_schedule(world_size)
        if saved is not None and now is not None and _shown(saved) != _shown(now):
            changes.append(f"{flag_name(field)} {_shown(now)} (saved with {_shown(saved)})")
    if not changes:
        return None
    return (f"resuming the checkpoint in {where} with {', '.join(changes)}: it continues at "
            "the same sample within rounding of the run that saved it, not bit for bit "
            "(each iteration's sums run in another order); the saved flags on as many "
            "processes continue it exactly")


def _shown(value: object) -> str:
    """A flag's value as the command line spells it (a list: comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _default_schedule(processes: int) -> str:
    return DEFAULT_SCHEDULE if processes > 1 else ONE_PROCESS_SCHEDULE
