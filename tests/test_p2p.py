"""Point-to-point transfers match by posting order only (as NCCL), a batch of transfers with
one peer goes out at once (a send and a receive crossing in it meet), and the checked mode
names the tensor that arrived when it is not the one the instruction expects."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.common.ports import reserved_port
from megatron.pipeline.p2p import MessageShape, PointToPoint, WrongMessageError
from megatron.schedules.instructions import Instruction, Op

pytestmark = pytest.mark.multiproc  # two processes over gloo

SHAPE = MessageShape((3, 2, 4), torch.float32)


def _send(op, stage, sub, mb, peer):
    return Instruction(op, stage=stage, sub=sub, mb=mb, peer=peer)


def _rank_main(rank, port, receive_order, results, staged=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        p2p = PointToPoint(SHAPE, torch.device("cpu"), rank, checked=True, staged=staged)
        # Same shape, different tensors: an activation and a checkpoint of one forward,
        # and a gradient that crosses the activation in the same step.
        act = torch.full(SHAPE.shape, 1.0)
        ckpt = torch.full(SHAPE.shape, 2.0)
        grad = torch.full(SHAPE.shape, 3.0)
        if rank == 0:
            work = p2p.isend(_send(Op.ISEND_CKPT, 1, 1, 0, 1), ckpt)
            (got,) = p2p.exchange([(_send(Op.SEND_ACT, 1, -1, 0, 1), act),
                                   (_send(Op.RECV_GRAD, 1, 0, 0, 1), None)])
            work.wait()
            results[0] = float(got[0, 0, 0])
            return
        posted = {}
        for kind in receive_order:
            if kind == "ckpt":
                posted["ckpt"] = p2p.irecv(_send(Op.IRECV_CKPT, 1, 1, 0, 0))
                continue
            # The send first: as two blocking calls, both ranks would be sending.
            batch = [(_send(Op.SEND_GRAD, 1, 0, 0, 0), grad),
                     (_send(Op.RECV_ACT, 1, -1, 0, 0), None)]
            try:
                (posted["act"],) = p2p.exchange(batch)
            except WrongMessageError as error:
                results[1] = str(error)
                # Drain what rank 0 still sends (the activation's header and the
                # activation) so that it finishes cleanly.
                for drained in (torch.empty(4, dtype=torch.int64), p2p.empty()):
                    dist.recv(drained, src=0)
                return
        work, buffer = posted["ckpt"]
        work.wait()
        results[1] = (float(posted["act"][0, 0, 0]), float(buffer[0, 0, 0]))
    finally:
        dist.destroy_process_group()


def _run(receive_order, staged=False):
    with reserved_port() as port, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(port, receive_order, results, staged), nprocs=2,
                           start_method="fork")
        return dict(results)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged-through-host"])
def test_receives_in_the_senders_order_get_the_right_tensors(staged):
    """`staged`: as CUDA ranks sharing a GPU over gloo (--share-gpu) post them: each
    transfer through a host copy, the receive's device buffer filled when it is waited."""
    results = _run(["ckpt", "act"], staged)
    assert results[1] == (1.0, 2.0)
    assert results[0] == 3.0  # the gradient sent in the same batch


def test_receives_out_of_order_fail_naming_what_arrived():
    message = _run(["act", "ckpt"])[1]
    assert isinstance(message, str), message
    assert "rank 1, RECV_ACT stage=1 mb=0 peer=0" in message
    assert "expected act stage=1 sub=-1 mb=0 from rank 0" in message
    assert "but ckpt stage=1 sub=1 mb=0 arrived" in message
