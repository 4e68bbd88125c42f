"""A TCP port for a process started later (a rank 0's store, torchrun's agent) that no other
process on the machine takes meanwhile.

Binding port 0 and closing the socket names a free port but frees it again: until the
started process binds it, any other process's port-0 bind (gloo's listeners, other jobs'
stores) may get it, and the start fails with EADDRINUSE. `reserved_port` keeps its socket
bound, with SO_REUSEADDR and not listening, while the caller needs the port: the kernel then
gives the port to no port-0 bind and no outgoing connection, and a socket that sets
SO_REUSEADDR itself, as torch's TCPStore does, still binds and listens on it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A free port of `host`, kept from every other port-0 bind until the block ends."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield holder.getsockname()[1]
