"""The memory model against what the runtime holds, and against autograd's own count.

One 2-process run of the small preset (2 iterations) gives, per rank, the device layer's
accounted peak by category, the shared-memory segments created on the node and the
process's private host memory; every term of the model must be within 15 % of it. The
same run checks the runtime's books against the kernel's view of the tensors they count:
the optimizer's state and the gradient pool are resident as booked, the device layer's
buffers no more than booked.
"""

import json
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.config.presets import ModelPreset, get_preset
from megatron.schedules.cost_model import backward_stage_params
from megatron.schedules.generators import build_schedule
from megatron.schedules.hardware import get_hardware
from megatron.schedules.instructions import Op
from megatron.schedules.memory_model import (
    MemoryShape,
    layer_saved_bytes,
    plan_memory,
    shortfalls,
)
from tests import forked_ranks

TOLERANCE = 0.15


def test_layer_working_memory_is_what_autograd_saves():
    """AWM of one decoder layer (and the head) from the formula vs the saved-tensor hook the
    executor uses, for a few shapes, both working dtypes and both attention kernels."""
    from megatron.models.llama import LlamaConfig
    from megatron.pipeline.executor import _saved_bytes
    from megatron.pipeline.stage_modules import build_stage_modules
    from megatron.schedules.memory_model import backward_stage_saved_bytes
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    initialize_distributed()
    try:
        for h, ffn, heads, kv, seq, b, dtype, attention in [
                (64, 160, 4, 2, 32, 2, torch.float32, "auto"),
                (64, 160, 4, 2, 32, 2, torch.float32, "unfused"),
                (128, 352, 8, 2, 64, 1, torch.bfloat16, "auto")]:
            vocab = 384  # a multiple of 128: Megatron's padding leaves it
            cfg = LlamaConfig(num_layers=2, hidden_size=h, ffn_hidden_size=ffn,
                              num_attention_heads=heads, num_query_groups=kv, vocab_size=vocab,
                              seq_length=seq, seed=1, attention_backend=attention)
            modules = build_stage_modules(cfg, (1, 1), 1, [(0, 0), (1, 0)], dtype)
            for m in modules.values():
                for p in m.module.parameters():
                    p.data = p.data.to(dtype)
            batch = {"tokens": torch.randint(0, vocab, (b, seq)),
                     "labels": torch.randint(0, vocab, (b, seq)),
                     "loss_mask": torch.ones(b, seq)}
            measured = {}
            with torch.no_grad():
                hidden = modules[(0, 0)](None, batch)
            for key, x in (((0, 0), None), ((1, 0), hidden.requires_grad_(True))):
                with torch.enable_grad(), _saved_bytes(modules[key].module) as saved:
                    modules[key](x, batch)
                measured[key] = saved.nbytes
            model = ModelPreset("t", 2, h, ffn, heads, kv, seq, vocab, attention_backend=attention)
            itemsize = torch.empty((), dtype=dtype).element_size()
            predicted = backward_stage_saved_bytes(model, (1, 1), 1, b, seq, itemsize)
            assert predicted == measured
            assert layer_saved_bytes(model, b * seq, seq, itemsize) < measured[(0, 0)]
    finally:
        shutdown_distributed()


def test_paper_node_fits_10b_but_not_110b_on_two_nodes():
    """The shape of the docs table: 110B on a quarter of the paper's nodes lacks host memory."""
    hardware = get_hardware("paper-v100")
    for name, nodes, fits in (("10b", 1, True), ("110b", 2, False)):
        preset = get_preset(name)
        ranks = 4 * nodes
        from megatron.schedules.cost_model import model_partition
        partition = model_partition(preset, 2 * ranks, min_layers=2)
        schedule = build_schedule("decoupled", ranks, 2 * ranks, 2, 8 * nodes, partition)
        plan = plan_memory(schedule, MemoryShape(preset, 2, 1024, 2, 4, procs_per_node=4),
                           hardware=hardware)
        missing = shortfalls(plan, hardware)
        assert (not missing) == fits, missing
        if not fits:
            assert "host memory" in {s.resource for s in missing}
            params = sum(backward_stage_params(preset, partition, 2).values())
            # fp32 master, m and v alone of half the model exceed a node's 512 GB
            assert 12 * params / nodes > hardware.host_memory_bytes


@pytest.mark.multiproc
def test_memory_model_matches_the_runtime_on_two_processes(tmp_path, demo_cache):
    from megatron.data.demo_corpus import ensure_demo_corpus
    from megatron.data.tokenizer import load_tokenizer
    from megatron.planning.shape import generate_schedule
    from megatron.training.arguments import parse_args

    cache = demo_cache
    # Built here first, so that the ranks' host memory is the run's, not the corpus build's.
    vocab = load_tokenizer(ensure_demo_corpus(cache_dir=cache).tokenizer_path).vocab_size
    flags = ["--model-preset", "small", "--train-iters", "2", "--global-batch-size", "8",
             "--seq-length", "64",
             "--data-cache-dir", cache]
    proc = forked_ranks.launch("tests/run_memory_probe.py", ["--out-dir", str(tmp_path), *flags],
                               2, env={"OMP_NUM_THREADS": "1"}, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        measured = [json.loads(line) for line in f][-1]["per_rank"]
    probes = [json.load(open(tmp_path / f"rank_{r}.json")) for r in range(2)]

    run = parse_args(flags)
    schedule = generate_schedule(run, 2, vocab)
    plan = plan_memory(schedule, MemoryShape(replace(get_preset("small"), vocab_size=vocab),
                                             run.training.micro_batch_size, run.model.seq_length,
                                             param_bytes=4, grad_host_bytes=4, procs_per_node=2,
                                             sends_complete=False))

    def close(predicted, actual, what):
        assert abs(predicted - actual) <= TOLERANCE * actual, (what, predicted, actual)

    for rank, row in enumerate(measured):
        gpu, at_peak = plan.per_gpu[rank], row["device_memory_at_peak"]
        # Activations are compared with the checkpoints they peak with: at the checkpoints'
        # peak they are a message or two (the model's, the validator's; the runtime's, its
        # batched transfers'), none of them anything autograd saves.
        for term, actual in at_peak.items():
            if term != "activations":
                close(gpu[term], actual, (rank, term))
        together = ("activation_checkpoints", "activations")
        close(sum(gpu[t] for t in together), sum(at_peak[t] for t in together),
              (rank, together))
        close(plan.gpu_total(rank, measured_only=True), row["device_memory_peak_bytes"],
              (rank, "device total"))
        # Host: the optimizer states and offloaded gradients of its stages, plus (the CPU
        # device layer lives in host memory) the device buffers that persist after the step.
        held = (sum(plan.per_process[rank].values()) + gpu["parameter_slots"]
                + gpu["gradient_buffers"])
        probe = probes[rank]
        close(held, probe["rss_anon_after"] - probe["rss_anon_before"], (rank, "host"))
        # the books are what the kernel holds: states and gradients written whole (each
        # tensor's last page partly beyond), the gradient pool one buffer per owned stage, as
        # planned
        books, resident = probe["books"], probe["resident"]
        for term in ("optimizer_states", "host_gradients"):
            assert 0 <= resident[term] - books[term] <= 64 * 4096, (rank, term, books, resident)
        assert books["host_gradients"] == plan.per_process[rank]["host_gradients"]
        assert books["optimizer_states"] == plan.per_process[rank]["optimizer_states"]
        # slots larger than a smaller stage's parameters are not all written
        assert 0 < resident["device_buffers"] <= books["device_buffers"] + 4096 * 8
    created = sum(p["created_segment_bytes"] for p in probes)  # one node
    close(plan.per_node[0]["shm_parameters"], created, "shm")
    # The run received checkpoints and sent some (both lifetimes are covered above).
    assert any(i.op == Op.IRECV_CKPT for i in schedule.programs[0])
    assert any(i.op == Op.ISEND_CKPT for p in schedule.programs for i in p)


@pytest.mark.unit
def test_slots_checkpoints_and_the_recompute_are_counted_at_one_moment():
    """An AFAB schedule holds every micro-batch's checkpoint of each backward stage a rank
    runs until that backward; the recompute's saved tensors come only after the first of
    them is used, and the forward's parameter slots are given back by then. The plan
    counts the three at the moment their sum peaks (decoupled, 2 forward stages per rank,
    d = 3), less than their own peaks added, where the checkpoints' peak (the forward's
    fresh ones not yet sent) is more than the schedule's need at a recompute."""
    from megatron.schedules.memory_model import backward_stage_saved_bytes
    from megatron.schedules.slot_plan import slot_numels
    from megatron.schedules.validator import validate

    preset = replace(get_preset("10b"), num_layers=24, vocab_size=32000)
    micro_batches, seq = 8, 256
    schedule = build_schedule("decoupled", 4, 8, 3, micro_batches)
    report = validate(schedule)
    plan = plan_memory(schedule, MemoryShape(preset, 1, seq, 2, 4), report=report)
    message = seq * preset.hidden_size * 2
    saved = backward_stage_saved_bytes(preset, schedule.partition, 3, 1, seq, 2)
    params = backward_stage_params(preset, schedule.partition, 3)
    together = ("parameter_slots", "activation_checkpoints", "activations")
    for rank in range(schedule.ranks):
        gpu = plan.per_gpu[rank]
        owned = schedule.owned_by(rank)
        used = {b: params[b] for b in params if b in owned or schedule.forward_rank[b[0]] == rank}
        slots = 2 * sum(slot_numels([schedule], rank, used))
        own_peaks = (slots + (report.peak_checkpoints[rank] + 1) * message
                     + max(saved[b] for b in owned) + 2 * message)
        assert sum(gpu[t] for t in together) < own_peaks
        assert gpu["activation_checkpoints"] <= (report.peak_checkpoints[rank] + 1) * message
    assert max(p + 1 - len(schedule.owned_by(r)) * micro_batches
               for r, p in enumerate(report.peak_checkpoints)) > 0


@pytest.mark.parametrize("name,split", [("decoupled", 3), ("mobius", 1), ("interleaved-1f1b", 1)])
def test_slots_are_sized_by_the_stages_they_take_and_the_runtime_takes_the_same(name, split):
    """The slot plan walks a rank's program as ParamSlots fills its slots (lowest free
    index): driving ParamSlots.sized through the same prefetches and releases never finds
    no room, holds what the memory model prices, and beats a uniform slot size on the
    ranks with the embedding's or the output layer's stage (larger than a layer's)."""
    from megatron.offload.device import get_device
    from megatron.offload.prefetch import ParamSlots
    from megatron.schedules.cost_model import model_partition
    from megatron.schedules.slot_plan import slot_elements_held, slot_numels, slots_given_back
    from megatron.schedules.validator import validate

    preset = replace(get_preset("10b"), num_layers=12, vocab_size=32000)
    schedule = build_schedule(name, 2, 4, split, 4, model_partition(preset, 4, min_layers=split))
    report = validate(schedule)
    numel = backward_stage_params(preset, schedule.partition, split)
    numel = {b: n // 10_000 for b, n in numel.items()}  # small tensors, the same proportions
    plan = plan_memory(schedule, MemoryShape(preset, 1, 64, 4, 4), report=report)
    saved = []
    for rank in range(schedule.ranks):
        sizes = slot_numels([schedule], rank, numel)
        assert len(sizes) == max(2, report.peak_params[rank])
        with get_device("cpu") as device:
            slots = ParamSlots.sized(device, list(sizes), torch.float32)
            held, released = {}, {}
            given_back = slots_given_back(schedule, rank)
            elements = slot_elements_held(schedule, rank, sizes)
            for index, ins in enumerate(schedule.programs[rank]):
                for b in schedule.params_of(ins.stage, ins.sub):
                    if ins.op == Op.PREFETCH_PARAMS:
                        held[b] = slots.prefetch(b, torch.zeros(numel[b]))
                        assert held[b].index == min(
                            i for i, s in enumerate(slots.slots)
                            if s is held[b] or not s.in_use)  # the lowest free index
                    elif ins.op == Op.RELEASE_PARAMS and b in held:
                        released[b] = held.pop(b)
                        slots.release(released[b])
                for b in given_back.get(index, ()):  # the slot is filled no more
                    slots.give_back(released[b])
                # the device layer's bytes for the slots, as the plan has them
                assert slots.nbytes == 4 * elements[index], (rank, index)
        full = slot_numels([schedule], rank, backward_stage_params(
            preset, schedule.partition, split))
        # the plan's at the moment the device peaks: all of them, or what is left then
        planned = {4 * n for n in slot_elements_held(schedule, rank, full)} | {4 * sum(full)}
        assert plan.per_gpu[rank]["parameter_slots"] in planned
        saved.append(len(full) * max(full) - sum(full))
    assert max(saved) > 0  # the rank with the embedding's or the head's stage


def test_head_working_memory_is_what_its_forward_and_backward_hold_at_their_peak():
    """The output layer's stage: what its recomputed forward and its backward hold at their
    peak beyond the stage's inputs and weights, measured from glibc's own count of the
    bytes it has handed out, sampled around every operator: autograd's saved tensors (the
    fp32 softmax megatron-core's cross-entropy keeps), the logits in the working dtype
    beside them (the memory model's operator working: the forward's output, then the
    backward's cast of the gradient the cross-entropy computes in place)."""
    import ctypes

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc without mallinfo2")
    held, planned, before = measure_head_memory()
    assert abs(planned - held) <= 0.05 * held, (planned, held)
    # the term before (the logits' gradient in fp32: 2 more bytes per logit) over-counted
    assert before - held > 0.15 * held


def measure_head_memory() -> tuple[int, int, int]:
    """(held, planned, the plan before): bytes at the head stage's peak, measured and
    planned (its saved tensors and operator working), 128 tokens x 16384 logits in bf16."""
    import ctypes

    from megatron.models.llama import LlamaConfig, build_piece
    from megatron.schedules.memory_model import head_saved_bytes
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    class MallInfo(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo

    def in_use() -> int:  # allocated and not freed: in the heap's arenas and mmap'd
        info = libc.mallinfo2()
        return info.hblkhd + info.uordblks

    class Peak(TorchDispatchMode):
        first = peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.first = self.first or in_use()  # before the first operator
            self.peak = max(self.peak, in_use())
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use())
            return out

    tokens, hidden, vocab = 128, 64, 16384
    initialize_distributed()
    try:
        cfg = LlamaConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=160,
                          num_attention_heads=4, num_query_groups=4, vocab_size=vocab,
                          seq_length=tokens)
        head = build_piece(cfg, 2).to(torch.bfloat16)
        x = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
        batch = {"labels": torch.randint(0, vocab, (1, tokens)),
                 "loss_mask": torch.ones(1, tokens)}
        head(x, batch).backward()  # once first: lazy imports and caches are not the head's
        x.grad = None
        for p in head.parameters():
            p.grad = None
        with Peak() as measured:
            head(x, batch).backward()
    finally:
        shutdown_distributed()
    # the peak (the forward's logits beside their fp32 copy, or the backward's cast of the
    # gradient) comes before the weights' and the input's gradients exist
    model = ModelPreset("t", 1, hidden, 160, 4, 4, tokens, vocab)
    saved = head_saved_bytes(model, tokens, 2)
    return measured.peak - measured.first, saved + tokens * vocab * 2, saved + tokens * vocab * 4


class OperatorBytes(TorchDispatchMode):
    """Bytes of the storages the operators inside the block allocate, less those of the
    storages they read that are freed, after every operator: `now` and `peak` relative to
    the block's start (a storage counts until its last reference is gone: torch keeps one
    Python object per storage, so a finalizer on it runs when the memory goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _track(self, tensor: torch.Tensor, allocated: bool) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        self._seen.add(storage)
        self.now += storage.nbytes() if allocated else 0
        weakref.finalize(storage, self._freed, storage.nbytes())

    def _freed(self, nbytes: int) -> None:
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, allocated=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, allocated=True)
        self.peak = max(self.peak, self.now)
        return out


def measure_working(piece: torch.nn.Module, x: torch.Tensor | None, batch: dict
                    ) -> tuple[int, int, int]:
    """(forward without grad, recompute, backward): what `piece` holds beyond its input and
    output (and, recomputing, beyond what it saves; in its backward, beyond what it held
    before), with its gradients bound to buffers as the executor binds them."""
    for p in piece.parameters():
        p.grad = torch.zeros_like(p)
    with torch.no_grad(), OperatorBytes() as forward:
        out = piece(x, batch)
    forward_beyond = forward.peak - max(0, forward.now)  # the output is held after it
    del out
    x = x.clone().requires_grad_(True) if x is not None else None
    with OperatorBytes() as recompute:
        out = piece(x, batch)
    recompute_beyond = recompute.peak - recompute.now  # beyond what it saves
    grad = torch.ones_like(out)
    with OperatorBytes() as backward:
        out.backward(grad)
    return (forward_beyond, recompute_beyond,
            backward.peak)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend, shape", [("unfused", (64, 176, 4, 4, 64, 1)),
                                            ("auto", (64, 48, 4, 2, 32, 2))])
def test_layer_forward_working_memory_covers_attention(dtype, backend, shape):
    """A decoder layer's no-grad forward where attention, not SwiGLU, holds the most:
    megatron-core's unfused attention (its scores and probabilities) and grouped-query
    attention through the kernel the runtime pins (math in fp32, flash in bf16), counted
    per operator after a first call (megatron-core's caches filled), with the scores'
    scratch megatron-core keeps between calls, within 10 % above; unfused attention's
    backward (and recompute) within the model's price. (The CPU's 5 KB RNG
    state, which megatron-core's RNG tracker reads around the attention dropout, is
    freed uncounted: the count runs 10 KB low after it in fp32 unfused.)"""
    from megatron.core import parallel_state

    from megatron.models.llama import LlamaConfig, build_piece
    from megatron.schedules.memory_model import layer_working_bytes
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    h, ffn, heads, kv, seq, b = shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    initialize_distributed()
    try:
        cfg = LlamaConfig(num_layers=1, hidden_size=h, ffn_hidden_size=ffn,
                          num_attention_heads=heads, num_query_groups=kv, vocab_size=64,
                          seq_length=seq, seed=1, attention_backend=backend)
        piece = build_piece(cfg.with_dtype(dtype), 1)
        x = torch.randn(seq, b, h, dtype=dtype)
        parallel_state.destroy_global_memory_buffer()
        parallel_state._set_global_memory_buffer()
        with torch.no_grad():
            piece(x, {})
            with OperatorBytes() as counted:
                out = piece(x, {})
        scratch = sum(t.nbytes for t in parallel_state.get_global_memory_buffer().buffer.values())
        _, recompute, backward = measure_working(piece, x, {})
    finally:
        shutdown_distributed()
    measured = counted.peak - out.untyped_storage().nbytes() + scratch
    model = ModelPreset("t", 1, h, ffn, heads, kv, seq, 64, attention_backend=backend)
    planned = layer_working_bytes(model, seq * b, seq, itemsize)
    assert measured <= planned.forward <= 1.1 * measured, (measured, planned)
    if backend == "unfused":  # the softmax backward's price is an upper bound
        assert max(recompute, backward) + scratch <= planned.backward, (
            recompute, backward, planned)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_working_memory_is_what_the_pieces_hold_beyond_their_tensors(dtype):
    """The memory model's operator working memory of a decoder layer, the head and the
    embedding against what megatron-core's modules, as the runtime builds them, allocate
    beyond their inputs, outputs and saved tensors, counted per operator: at two shapes
    (tokens above and below the hidden size: the weight gradient's moment and the
    activations' one), covered within 10 %."""
    from megatron.schedules.memory_model import (
        embedding_working_bytes,
        head_working_bytes,
        layer_working_bytes,
    )
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    initialize_distributed()  # the head's cross-entropy all-reduces over its group
    try:
        check_operator_working(dtype, embedding_working_bytes, layer_working_bytes,
                               head_working_bytes)
    finally:
        shutdown_distributed()


def check_operator_working(dtype, embedding_working_bytes, layer_working_bytes,
                           head_working_bytes) -> None:
    from megatron.models.llama import LlamaConfig, build_piece

    itemsize = torch.empty((), dtype=dtype).element_size()
    for h, ffn, heads, kv, seq, b, vocab in [(64, 176, 4, 2, 32, 4, 512),
                                             (128, 352, 4, 4, 32, 2, 384)]:
        cfg = LlamaConfig(num_layers=1, hidden_size=h, ffn_hidden_size=ffn,
                          num_attention_heads=heads, num_query_groups=kv, vocab_size=vocab,
                          seq_length=seq, seed=1)
        model = ModelPreset("t", 1, h, ffn, heads, kv, seq, vocab)
        tokens = seq * b
        batch = {"tokens": torch.randint(0, vocab, (b, seq)),
                 "labels": torch.randint(0, vocab, (b, seq)), "loss_mask": torch.ones(b, seq)}
        x = torch.randn(seq, b, h, dtype=dtype)
        for index, planned in ((0, embedding_working_bytes(model, tokens, itemsize)),
                               (1, layer_working_bytes(model, tokens, seq, itemsize)),
                               (2, head_working_bytes(model, tokens, itemsize))):
            piece = build_piece(cfg.with_dtype(dtype), index)
            forward, recompute, backward = measure_working(piece, x if index else None, batch)
            shape = (h, ffn, tokens, dtype, index)
            assert forward <= planned.forward <= 1.1 * forward, (shape, forward, planned)
            assert max(recompute, backward) <= planned.backward <= 1.1 * backward, (
                shape, recompute, backward, planned)


@pytest.mark.unit
@pytest.mark.parametrize("dtype, chunks", [(torch.float32, 2), (torch.bfloat16, 4)])
def test_no_grad_swiglu_over_pieces_holds_what_the_model_prices(dtype, chunks):
    """The no-grad MLP over pieces of the sequence (100 positions: uneven pieces) holds,
    beyond its output, one piece's fc1 and fc2 outputs, as swiglu_working_bytes prices it
    (less the residual and the output it counts), and gives megatron-core's MLP's bits."""
    from megatron.core.transformer.mlp import MLP

    from megatron.config.model import ModelConfig
    from megatron.models.llama import LlamaConfig, build_piece
    from megatron.schedules.memory_model import swiglu_chunks, swiglu_working_bytes
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    h, ffn, heads, groups, seq, batch = 432, 1152, 3, 1, 100, 3
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = ModelConfig("t", 1, h, ffn, heads, groups, seq, None)
    x = torch.randn(seq, batch, h, dtype=dtype)
    initialize_distributed()
    try:
        piece = build_piece(LlamaConfig(
            num_layers=1, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
            num_query_groups=groups, vocab_size=64, seq_length=seq, seed=1).with_dtype(dtype), 1)
        mlp = piece.layer.mlp
        assert swiglu_chunks(shape, seq * batch, seq, itemsize) == chunks == mlp._chunks(x)
        with torch.no_grad():
            mlp(x)
            with OperatorBytes() as counted:
                out, _ = mlp(x)
            megatron_core, _ = MLP.forward(mlp, x)
    finally:
        shutdown_distributed()
    planned = swiglu_working_bytes(shape, seq * batch, seq, itemsize, chunks)
    assert counted.peak - out.untyped_storage().nbytes() == planned - 2 * h * seq * batch * itemsize
    assert torch.equal(out, megatron_core)
