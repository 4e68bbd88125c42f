"""Parameters across nodes: the owner pushes a stage's published parameters to the nodes
that run its forward, into their local store.

On the receiving node one process holds a replica segment (it `create`s it in its own
store, so cleanup works as for any segment) and calls `receive_parameters`, which writes
straight into shared memory and publishes the version; local readers then see it
through the usual `wait_version`. Point-to-point over torch.distributed; the payload is
the segment's bytes (gloo on the CPU; on GPUs a NCCL group would need a device bounce
buffer, which the executor owns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.offload.shm import SharedSegment


def push_parameters(
    segment: SharedSegment, dst_ranks: list[int], group: dist.ProcessGroup | None = None,
    version: int | None = None,
) -> None:
    """Send the segment's parameters as `version` (default: its published version) to each
    rank in `dst_ranks`."""
    version = torch.tensor([segment.version if version is None else version],
                           dtype=torch.int64)
    payload = segment.params.view(torch.uint8)
    for dst in dst_ranks:
        dist.send(version, dst, group=group)
        dist.send(payload, dst, group=group)


def receive_parameters(
    segment: SharedSegment, src_rank: int, group: dist.ProcessGroup | None = None,
    republish: bool = False, on_arrival: Callable[[], None] | None = None,
) -> int:
    """Receive a pushed version into `segment` (a local replica) and publish it
    (`republish`: the version it holds, see SharedSegment.publish). `on_arrival` is called
    once the bytes are in, before the version is published (a reader may start at once)."""
    version = torch.empty(1, dtype=torch.int64)
    dist.recv(version, src_rank, group=group)
    segment.begin_write()
    dist.recv(segment.params.view(torch.uint8), src_rank, group=group)
    if on_arrival is not None:
        on_arrival()
    segment.publish(int(version.item()), republish)
    return int(version.item())
