"""Host bytes: what the runtime allocates beyond the model states, and the figures that
measure it (bench/host_memory.py measures whole runs; these are its pieces, in one process).

- the kernel's view: resident bytes of tensors by mincore(2), each page once;
- no second copy of the masters at start-up (the CPU optimizer keeps the masters it is
  given), of the initial weights (one stage's at a time, the others never written) or of
  the states at a checkpoint save (views with storages of their own size);
- the host gradients' dtype follows Megatron-LM's two flags on every device.
"""

from dataclasses import replace

import pytest
import torch

from bench.host_memory import storage_spans
from megatron.common.host_allocator import return_free_memory
from megatron.common.process_memory import PAGE, memory_status, reset_peak, resident_bytes
from megatron.config.run import host_gradient_dtype
from megatron.models.llama import LlamaConfig, build_pieces
from megatron.offload.device import get_device
from megatron.offload.host_memory import HostBufferPool
from megatron.optimizer.cpu_adam import CPUAdamW
from megatron.pipeline.checkpoint_views import own_storage
from megatron.pipeline.config import TORCH_DTYPES
from megatron.pipeline.stage_modules import (
    build_stage_modules,
    drop_parameters,
    initial_parameters,
)
from megatron.training.arguments import parse_args
from megatron.training.distributed import initialize_distributed, shutdown_distributed

pytestmark = pytest.mark.unit
CFG = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                  num_query_groups=2, vocab_size=256, seq_length=16, seed=7)


def test_resident_bytes_count_the_pages_written_once_each():
    # 64 MiB: above malloc's largest mmap threshold, fresh pages not resident until written.
    # malloc serves a request of any size from the free memory its heaps hold (the
    # threshold only decides how they grow), resident when an earlier test of the session
    # wrote it (after a whole training run: tens of MiB): returned to the kernel first
    return_free_memory()
    buffer = torch.empty(16 << 20)
    assert resident_bytes(storage_spans([buffer])) < 4 * PAGE
    buffer[: 1 << 20].fill_(1.0)
    assert 4 << 20 <= resident_bytes(storage_spans([buffer])) <= (4 << 20) + 4 * PAGE
    buffer.fill_(1.0)
    # a view counts its storage's pages, and two views of one storage count them once
    whole = resident_bytes(storage_spans([buffer]))
    assert resident_bytes(storage_spans([buffer[:10], buffer[-10:]])) == whole >= buffer.nbytes


def test_the_kernels_peak_restarts_at_the_current_size():
    big = torch.ones(16 << 20)
    peak = memory_status()["peak"]
    del big
    reset_peak()
    assert memory_status()["peak"] <= peak


def test_the_optimizer_keeps_the_masters_it_is_given_without_a_copy():
    master = torch.randn(1000)
    groups = [master[:600], master[600:]]
    adam = CPUAdamW(groups, adopt=True, threads=1)
    assert all(adam.master(g).data_ptr() == groups[g].data_ptr() for g in range(2))
    copied = CPUAdamW(groups, threads=1)  # the default: a copy the caller cannot disturb
    assert copied.master(0).data_ptr() != groups[0].data_ptr()
    # a master in another dtype is converted, adopted or not
    bf16 = CPUAdamW(groups, adopt=True, threads=1, master_dtype=torch.bfloat16)
    assert bf16.master(0).dtype == torch.bfloat16
    assert torch.equal(bf16.master(1), groups[1].to(torch.bfloat16))


@pytest.fixture
def process_group():
    initialize_distributed()  # megatron-core's layers read its parallel state
    yield
    shutdown_distributed()


def test_a_pipelines_modules_are_never_written_and_its_masters_built_one_stage_at_a_time(
        process_group):
    keys = [(0, 0), (1, 0)]
    built = build_stage_modules(CFG, (1, 1), 1, keys, torch.bfloat16, initialize=False)
    reference = build_stage_modules(CFG, (1, 1), 1, keys, torch.bfloat16)
    for key in keys:
        flat = initial_parameters(CFG, built[key])
        want = torch.cat([p.detach().reshape(-1) for _, p in sorted(
            reference[key].module.named_parameters(),
            key=lambda np: [s.name for s in reference[key].layout.slices].index(np[0]))])
        assert flat.dtype == torch.float32 and torch.equal(flat, want), key
    # an uninitialized piece's weights were allocated, never written: a large one (50 MB,
    # fresh pages from the kernel, once malloc's free memory is returned) holds no memory
    return_free_memory()
    large = replace(CFG, vocab_size=196608).with_dtype(torch.float32)
    weight = build_pieces(large, [0], initialize=False)[0].embedding.word_embeddings.weight
    assert resident_bytes(storage_spans([weight])) < weight.nbytes // 100
    drop_parameters(built[(0, 0)], torch.device("cpu"))
    assert all(p.numel() == 0 and p.dtype == torch.bfloat16
               for p in built[(0, 0)].module.parameters())


def test_checkpoint_views_have_storages_of_their_own_size_on_the_same_memory():
    flat = torch.zeros(100, dtype=torch.bfloat16)
    view = flat[10:30].view(4, 5)
    alias = own_storage(view)
    assert alias.untyped_storage().nbytes() == view.nbytes  # nothing for a writer to clone
    assert alias.data_ptr() == view.data_ptr() and alias.shape == view.shape
    alias.fill_(3.0)  # a load fills the optimizer's buffer in place
    assert torch.equal(flat[10:30], torch.full((20,), 3.0, dtype=torch.bfloat16))
    assert flat[:10].eq(0).all() and flat[30:].eq(0).all()
    del flat, view
    assert alias.sum().item() == 60.0  # the alias keeps the memory alive


def test_the_gradient_pool_reports_what_it_holds():
    with get_device("cpu") as dev:
        pool = HostBufferPool(dev, 1 << 20)
        assert pool.allocated_bytes == 0 and pool.buffers() == []
        a = pool.acquire(1000, torch.bfloat16)
        b = pool.acquire(500, torch.float32)
        pool.release(a)
        held = pool.buffers()
        assert {t.data_ptr() for t in held} == {a.data_ptr(), b.data_ptr()}
        assert pool.allocated_bytes == sum(t.nbytes for t in held) == 4000


@pytest.mark.parametrize("working,bf16_flag,fp32_flag,expected", [
    ("bf16", False, False, "fp32"),  # Megatron-LM's bf16 default, on every device
    ("bf16", True, False, "bf16"),  # --grad-reduce-in-bf16
    ("bf16", True, True, "bf16"),  # it wins over the other flag, as in Megatron-LM
    ("bf16", False, True, "fp32"),  # --accumulate-allreduce-grads-in-fp32: the default
    ("fp16", False, False, "fp16"),  # Megatron-LM's fp16 default: the parameters' dtype
    ("fp16", False, True, "fp32"),  # --accumulate-allreduce-grads-in-fp32
    ("fp16", True, False, "fp16"),  # bf16 reduction of an fp16 run: no effect
    ("fp32", True, False, "fp32"),
])
def test_the_main_gradient_dtype_follows_megatrons_flags(working, bf16_flag, fp32_flag,
                                                         expected):
    assert host_gradient_dtype(working, bf16_flag, fp32_flag) == expected


def test_the_flags_reach_the_precision_and_the_plans_price_them():
    base = ["--model-preset", "tiny", "--bf16"]
    run = parse_args([*base, "--grad-reduce-in-bf16"])
    assert run.precision.host_gradient_bytes == 2
    assert parse_args(base).precision.host_gradient_bytes == 4
    fp16 = parse_args(["--model-preset", "tiny", "--fp16"]).precision
    assert fp16.host_gradient_bytes == 2
    fp32 = parse_args(["--model-preset", "tiny", "--fp16",
                       "--accumulate-allreduce-grads-in-fp32"]).precision
    assert TORCH_DTYPES[fp32.host_gradient_dtype] == torch.float32


@pytest.mark.unit
def test_the_opt_in_copies_of_the_states_are_priced_when_on(tmp_path):
    """--optimizer-exact-rollback keeps a snapshot of each step (the optimizer's books count
    it: the states twice), --async-save a snapshot to write from: each adds the owned states
    once more to the plan's host memory; on NVMe exact rollbacks cost nothing."""
    from megatron.planning.run_plan import run_start

    base = ["--model-preset", "tiny", "--bf16", "--pipeline-schedule", "decoupled"]
    save = ["--save", str(tmp_path / "ckpt")]

    def states(*flags: str) -> list[int]:
        plan = run_start(parse_args([*base, *flags]), 2, 2, on_cuda=False).memory
        return [p["optimizer_states"] for p in plan.per_process]

    plain = states()
    assert states(*save) == plain  # a synchronous save writes from the live buffers
    assert states("--optimizer-exact-rollback") == [2 * s for s in plain]
    assert states(*save, "--async-save") == [2 * s for s in plain]
    assert states(*save, "--async-save", "--optimizer-exact-rollback") == [3 * s for s in plain]
    nvme = ["--optimizer-state-location", "nvme", "--optimizer-nvme-path", str(tmp_path)]
    assert states(*nvme, "--optimizer-exact-rollback") == states(*nvme)
    params = [torch.zeros(1000)]
    books = [CPUAdamW(params, threads=1, exact_rollback=exact).host_state_bytes()
             for exact in (False, True)]
    assert books[1] == 2 * books[0]


@pytest.mark.multiproc
def test_the_main_gradients_are_summed_as_one_process_sums_them_in_either_dtype(tmp_path,
                                                                                 demo_cache):
    """A bf16 pipeline sums each backward stage's micro-batch gradients in the main
    gradients' dtype, as the one-process run does: fp32 by default (Megatron-LM's), bf16
    with --grad-reduce-in-bf16. Each trains as one process with the same flags (losses
    within 1e-5; gradient norms within 1e-4: a stage's bf16 backward and the whole model's
    round a few gradients apart, 2.3e-5 of the norm in either dtype); the two dtypes give
    different gradient norms from the first iteration (a bf16 sum of 4 micro-batches
    rounds: 1.3e-5 of the norm here), and the bf16 host gradient pool holds half the bytes.
    The sums themselves are checked bit for bit in
    test_micro_batch_gradients_are_summed_in_the_main_gradients_dtype."""
    from tests.test_pipeline_executor import metrics, start

    # 4 layers (the gradients' dtype is the property, not the depth or the ranks): the
    # one-rank decoupled pipeline, 2 forward stages each split in 2 backward stages as the
    # test model's 8 layers are by default; its host gradient pool is a pipeline's
    bf16 = ["--bf16", "--eval-iters", "0", "--cpu-optimizer-threads", "1", "--train-iters", "3",
            "--num-layers", "4"]
    pipeline = ["--pipeline-schedule", "decoupled", "--forward-stages", "2",
                "--backward-split", "2"]
    runs = {name: start(tmp_path, name, 1, *bf16, *flags) for name, flags in (
        ("one fp32", []), ("one bf16", ["--grad-reduce-in-bf16"]),
        ("fp32", pipeline), ("bf16", [*pipeline, "--grad-reduce-in-bf16"]))}
    runs = {name: job.wait() for name, job in runs.items()}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-4000:]
    rows = {name: metrics(run) for name, run in runs.items()}
    for dtype in ("fp32", "bf16"):
        for a, b in zip(rows[dtype], rows[f"one {dtype}"], strict=True):
            for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4)):
                assert a[key] == pytest.approx(b[key], rel=rel), (dtype, key, a, b)
    assert rows["fp32"][0]["grad_norm"] != rows["bf16"][0]["grad_norm"]
    assert 2 * rows["bf16"][-1]["host_gradient_pool_bytes"] == \
        rows["fp32"][-1]["host_gradient_pool_bytes"] > 0
