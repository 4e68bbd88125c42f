"""The launcher's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT, as torchrun sets them (or a Slurm script or a hand-written launch does).

Checked once, before the command line is read: a value torchrun would never set is bad
input, one line naming the variable, its value and what was expected, instead of the
ValueError traceback of the first int() that reads it, or a process that trains as rank 0
of 1 with RANK=3 ignored (Megatron-LM fails on it).

Imports only the standard library and the error type (pretrain_llama.py reads the rank
before torch is imported).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron.config.errors import ConfigError

_PORTS = range(1, 65536)


def _whole(env: Mapping[str, str], name: str, least: int, meaning: str) -> int | None:
    """`env[name]` as a whole number >= `least`; None when it is not set."""
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"environment variable {name}", repr(raw),
                          f"expected a whole number >= {least} ({meaning}, as torchrun "
                          "sets it)")
    return value


def _shown(raw: str | None) -> str:
    return "(not set)" if raw is None else repr(raw)


def check_launcher_env(env: Mapping[str, str] = os.environ) -> None:
    """ConfigError for the first variable a launcher set wrong; nothing when none is set
    (one process)."""
    rank = _whole(env, "RANK", 0, "this process's rank")
    world = _whole(env, "WORLD_SIZE", 1, "the number of processes of the job")
    local_rank = _whole(env, "LOCAL_RANK", 0, "this process's rank on its node")
    local_world = _whole(env, "LOCAL_WORLD_SIZE", 1, "the number of processes on this node")
    if rank is not None and rank >= (world or 1):
        raise ConfigError("environment variable RANK", rank,
                          f"expected a rank below WORLD_SIZE {world or '(not set: 1)'}")
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise ConfigError("environment variable LOCAL_RANK", local_rank,
                          f"expected a rank below LOCAL_WORLD_SIZE {local_world}")
    if local_world is not None and world is not None and local_world > world:
        raise ConfigError("environment variable LOCAL_WORLD_SIZE", local_world,
                          f"expected at most WORLD_SIZE {world} (the processes of the job)")
    if rank is None or world is None:
        return  # no rendezvous through the environment: one process
    if not env.get("MASTER_ADDR", "").strip():
        raise ConfigError("environment variable MASTER_ADDR", _shown(env.get("MASTER_ADDR")),
                          "expected the address of rank 0's node (RANK and WORLD_SIZE are "
                          "set: the ranks meet there)")
    port = env.get("MASTER_PORT")
    try:
        valid = port is not None and int(port.strip()) in _PORTS
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError("environment variable MASTER_PORT", _shown(port),
                          "expected a TCP port 1-65535 on rank 0's node (RANK and "
                          "WORLD_SIZE are set: the ranks meet there)")


def speaks_for_the_job(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process prints the job's one line of bad input: rank 0, a process
    without a rank, or one whose RANK or WORLD_SIZE is itself the bad input (rank 0 may not
    see it)."""
    raw, world = env.get("RANK", "0").strip(), env.get("WORLD_SIZE", "1").strip()
    if not (raw.isdigit() and world.isdigit()):
        return True
    return int(raw) == 0 or int(raw) >= int(world)  # an out-of-range rank: its own fault


def launcher_rank(env: Mapping[str, str] = os.environ) -> int | None:
    """RANK as a number; None when it is not set or not a rank (check_launcher_env says
    which)."""
    raw = env.get("RANK", "").strip()
    return int(raw) if raw.isdigit() else None
