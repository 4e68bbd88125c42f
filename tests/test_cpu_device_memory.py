"""The CPU device layer's device memory capacity (MEGATRON_CPU_DEVICE_MEMORY): refused in
one line when malformed, reported free as torch.cuda.mem_get_info reports a GPU's, out of
memory beyond it as CUDA's allocator is, and what the fit check and auto's subgroups size
against."""

import pytest
import torch
import torch.distributed as dist

from megatron.offload.device import CPU_DEVICE_MEMORY_ENV, DeviceLayer
from megatron.training.training import main

MIB = 2**20


@pytest.mark.parametrize("text", ["12 apples", "-1MiB", "0", "MiB"])
def test_a_bad_capacity_is_one_line_before_anything_starts(text, monkeypatch, capsys):
    if dist.is_initialized():
        pytest.skip("a process group from an earlier test: the refusal comes before one")
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, text)
    with pytest.raises(SystemExit) as stop:
        main(["--model-preset", "tiny", "--train-iters", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{CPU_DEVICE_MEMORY_ENV} {text!r}: expected a byte count" in err[0]
    assert not dist.is_initialized()


def test_free_memory_is_the_capacity_less_what_the_layer_holds(monkeypatch):
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, "1MiB")
    with DeviceLayer("cpu") as layer:
        assert layer.mem_get_info() == (MIB, MIB)
        half = layer.empty(MIB // 8, torch.float32)  # 512 KiB
        assert layer.mem_get_info() == (MIB // 2, MIB)
        with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 768.00 KiB with "
                           r"512.00 KiB held; its capacity is 1.00 MiB \(MEGATRON_CPU"):
            layer.zeros(3 * MIB // 16, torch.float32)
        assert layer.device_bytes == half.nbytes  # the refused buffer is not counted
        del half
        assert layer.mem_get_info() == (MIB, MIB)
        layer.empty(MIB // 4, torch.float32)  # all of it, once the other is gone
        # what the executor holds beyond the layer's buffers (activations) counts too
        layer.memory.observe({"parameter_slots": MIB // 2, "activations": MIB // 2})
        with pytest.raises(torch.OutOfMemoryError, match=r"the runtime holds 1.00 MiB "
                           r"\(parameter slots 512.00 KiB, activations 512.00 KiB, "
                           r"optimizer subgroups 1 B\)"):
            layer.memory.observe({"parameter_slots": MIB // 2, "activations": MIB // 2,
                                  "optimizer_subgroups": 1})


def test_unset_the_layer_is_unbounded(monkeypatch):
    monkeypatch.delenv(CPU_DEVICE_MEMORY_ENV, raising=False)
    with DeviceLayer("cpu") as layer:
        assert layer.mem_get_info() is None and layer.capacity_bytes is None
        layer.memory.observe({"activations": 2**50})  # the book only records
        assert layer.memory.peak_bytes == 2**50


def _tiny_run(stride: str):
    from megatron.training.arguments import parse_args

    return parse_args(["--model-preset", "tiny", "--pipeline-schedule", "decoupled",
                       "--optimizer-gpu-stride", stride, "--vocab-size", "1000"])


def test_the_fit_check_and_autos_headroom_take_the_capacity(monkeypatch):
    """The start's fit check (free_memory as the trainer measures it) on the CPU layer with
    a capacity: refused in one line below the rank's plan, as a GPU is; above it, auto's
    subgroups get what the capacity leaves, no more than the host's share."""
    from megatron.planning.fit import ResourceError
    from megatron.planning.run_plan import run_start
    from megatron.training.fit_check import free_memory, refuse_what_does_not_fit

    run = _tiny_run("auto")
    plan = run_start(run, 2, procs_per_node=2, on_cuda=False).memory
    need = max(plan.gpu_total(r) for r in range(2))
    rank = next(r for r in range(2) if plan.gpu_total(r) == need)
    monkeypatch.delenv(CPU_DEVICE_MEMORY_ENV, raising=False)
    unbounded = refuse_what_does_not_fit(plan, run, rank, free_memory())
    assert free_memory().device is None and free_memory().device_in_host
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, str(need - 1))
    with pytest.raises(ResourceError) as refused:
        refuse_what_does_not_fit(plan, run, rank, free_memory())
    line = str(refused.value)
    assert line.startswith(f"CPU device memory ({CPU_DEVICE_MEMORY_ENV}): rank {rank} would "
                           "need") and "\n" not in line
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, str(need + 3 * MIB))
    free = free_memory()
    assert free.device == need + 3 * MIB and free.device_in_host
    assert refuse_what_does_not_fit(plan, run, rank, free) == min(3 * MIB, unbounded)


def test_a_one_process_run_is_held_to_the_capacity(monkeypatch):
    from megatron.config.device_choice import DeviceChoice
    from megatron.planning.fit import ResourceError
    from megatron.training.fit_check import refuse_single_process_that_does_not_fit

    run = _tiny_run("0")
    on_cpu = DeviceChoice("cpu", 0, "gloo")
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, "1MiB")
    with pytest.raises(ResourceError, match=r"^CPU device memory \(MEGATRON_CPU_DEVICE_MEMORY\)"
                       r": the one-process run would need .*, 1.00 MiB available"):
        refuse_single_process_that_does_not_fit(run, 1000, on_cpu)
    monkeypatch.setenv(CPU_DEVICE_MEMORY_ENV, "1TiB")
    refuse_single_process_that_does_not_fit(run, 1000, on_cpu)
