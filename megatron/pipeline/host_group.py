"""The process group for collectives on host tensors (overflow flags, timings, parameter
pushes): NCCL only moves device tensors, so under NCCL these go through a gloo group over
the same ranks, created once; under gloo the default group serves.

Every gloo group the runtime makes comes from `gloo_group`, with the job's collective
timeout (--distributed-timeout-minutes): torch gives a new group 30 minutes whatever the
default group has, so a rank that stopped answering would hold the others that long in a
collective of one group and for the flag's minutes in another."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_host_group: dist.ProcessGroup | None = None
_timeout: timedelta | None = None  # the default group's, set when it is created


def set_group_timeout(timeout: timedelta) -> None:
    """The collective timeout of the groups made from now on (the default group's)."""
    global _timeout
    _timeout = timeout


def gloo_group(ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A gloo group over `ranks` (None: all), with the job's collective timeout.
    Collective: every rank makes every group, in the same order."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=_timeout)


def host_group() -> dist.ProcessGroup | None:
    """None (the default group) under gloo; a gloo group over all ranks otherwise."""
    global _host_group
    if dist.get_backend() == "gloo":
        return None
    if _host_group is None:
        _host_group = gloo_group()
    return _host_group


def forget_host_group() -> None:
    """Called when the default group is destroyed: the next job creates its own."""
    global _host_group
    _host_group = None
