"""Bad input that needs the file system or a checkpoint, checked before training starts:
output paths that cannot be written, a --load directory that does not exist, model flags
that differ from the checkpoint's. Each is one line naming the flag, the value and what was
expected (ArgumentError, exit status 2), raised before anything is allocated or written.
"""

from __future__ import annotations

import argparse
import os

from megatron.training.arguments import MODEL_FLAGS, ArgumentError, check_writable_dir

OUTPUT_FILE_FLAGS = ("metrics_file", "timeline", "trace")


def check_output_paths(args: argparse.Namespace) -> None:
    """Every file or directory the run will write is writable now (leaving nothing behind
    but the directories the run would create anyway)."""
    if args.save:
        check_writable_dir("--save", args.save)
    if args.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", args.tensorboard_dir)
    for name in OUTPUT_FILE_FLAGS:
        path = getattr(args, name)
        if path:
            check_writable_file("--" + name.replace("_", "-"), path)


def check_writable_file(flag: str, path: str) -> None:
    """`path` can be created or appended to: not a directory, its directory writable."""
    if os.path.isdir(path):
        raise ArgumentError(flag, path, "expected a file path, found a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ArgumentError(flag, path, "expected a writable file (permission denied)")
    try:
        check_writable_dir(flag, os.path.dirname(os.path.abspath(path)))
    except ArgumentError as exc:
        raise ArgumentError(flag, path, f"its directory is not writable ({exc.expected})") from None


def check_load_dir(args: argparse.Namespace) -> None:
    """--load of a directory that does not exist is a mistake (a typo would silently train
    from scratch), unless --load-optional asks for Megatron's behaviour."""
    if args.load and not os.path.isdir(args.load) and not args.load_optional:
        raise ArgumentError("--load", args.load,
                            "expected an existing checkpoint directory (add --load-optional "
                            "to start from scratch when it does not exist)")


def check_checkpoint_args(args: argparse.Namespace, saved: dict | None, where: str) -> None:
    """The model flags of this run equal those the checkpoint in `where` was saved with."""
    for name in MODEL_FLAGS:
        theirs, ours = (saved or {}).get(name), getattr(args, name)
        if theirs is not None and ours is not None and theirs != ours:
            raise ArgumentError("--" + name.replace("_", "-"), ours,
                                f"the checkpoint in {where} was saved with {theirs}")
