"""The pieces together, as the executor uses them: store -> double buffer -> compute ->
gradient offload -> host optimizer -> publish, trained against plain torch SGD."""

import uuid

import torch
from torch import nn

from megatron.offload.device import get_device
from megatron.offload.grad_offload import GradientOffloader
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.layout import FlatLayout, bind_gradients, copy_parameters_into
from megatron.offload.param_store import ParameterStore, job_segments
from megatron.offload.prefetch import ParamSlots

LR, ITERATIONS, MICRO_BATCHES = 0.1, 3, 4


def make_stages() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 2)]


def test_offloaded_training_matches_torch_sgd_on_a_resident_model():
    torch.manual_seed(4)
    data = [[torch.randn(5, 8) for _ in range(MICRO_BATCHES)] for _ in range(ITERATIONS)]

    reference = nn.Sequential(*make_stages())
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    for batches in data:
        sgd.zero_grad()
        for x in batches:
            reference(x).square().mean().backward()
        sgd.step()

    stages = make_stages()
    keys = [(0, 0), (1, 0)]
    layouts = [FlatLayout.from_module(m) for m in stages]
    job_id = f"test-{uuid.uuid4().hex}"
    with get_device("cpu") as dev, ParameterStore(job_id=job_id, rank=0) as store:
        masters = []  # the CPU optimizer's fp32 master copies
        for key, module, layout in zip(keys, stages, layouts):
            segment = store.create(key, layout.numel, torch.float32)
            copy_parameters_into(module, layout, segment.params)
            segment.publish(0)
            masters.append(segment.params.clone())
        budget = 2 * max(lay.nbytes for lay in layouts)
        buf = ParamSlots(dev, budget_bytes=budget, dtype=torch.float32)
        offloader = GradientOffloader(dev, HostBufferPool(dev, 4 * budget), torch.float32)
        grads = [dev.zeros(lay.numel, torch.float32) for lay in layouts]
        for module, layout, flat_grad in zip(stages, layouts, grads):
            bind_gradients(module, layout, flat_grad)

        for iteration, batches in enumerate(data):
            slots = []
            for key, module, layout in zip(keys, stages, layouts):
                segment = store.get(key)
                segment.wait_version(iteration)  # parameters of this iteration
                slot = buf.prefetch(key, segment.params)
                buf.bind(slot, module, layout)
                slots.append(slot)
            for x in batches:
                stages[1](stages[0](x)).square().mean().backward()
            for slot in slots:
                buf.release(slot)
            ready = [offloader.offload(key, g) for key, g in zip(keys, grads)]
            for key, master, handle, flat_grad in zip(keys, masters, ready, grads):
                handle.wait()  # the CPU optimizer task's only call
                master.sub_(LR * handle.host)
                handle.release()
                flat_grad.zero_()
                store.get(key).write(master, version=iteration + 1)

        trained = torch.cat([store.get(k).params for k in keys])
        expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(trained, expected)
    assert job_segments(job_id) == []
