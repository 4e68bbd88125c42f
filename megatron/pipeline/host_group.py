"""The process group for collectives on host tensors (overflow flags, timings, parameter
pushes): NCCL only moves device tensors, so under NCCL these go through a gloo group over
the same ranks, created once; under gloo the default group serves."""

from __future__ import annotations

import torch.distributed as dist

_host_group: dist.ProcessGroup | None = None


def host_group() -> dist.ProcessGroup | None:
    """None (the default group) under gloo; a gloo group over all ranks otherwise."""
    global _host_group
    if dist.get_backend() == "gloo":
        return None
    if _host_group is None:
        _host_group = dist.new_group(backend="gloo")
    return _host_group


def forget_host_group() -> None:
    """Called when the default group is destroyed: the next job creates its own."""
    global _host_group
    _host_group = None
