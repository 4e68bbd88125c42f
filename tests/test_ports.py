"""A reserved port (megatron/common/ports.py) is kept from other processes' binds while the
store started for it still binds and listens there."""

import socket

import pytest
import torch.distributed as dist

from megatron.common.ports import reserved_port


def test_a_reserved_port_is_taken_by_no_other_bind_but_a_store_listens_on_it():
    with reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))  # what another process's bind meets
    with socket.socket() as later:  # the block's end freed it
        later.bind(("127.0.0.1", port))
    with reserved_port() as port:
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        store.set("rank 0", "listening")
        assert client.get("rank 0") == b"listening"
