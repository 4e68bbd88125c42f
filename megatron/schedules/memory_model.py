"""How much memory a run needs, per GPU and per node, before anything is allocated.

The terms follow ZeRO-Infinity's section 3 (model states, residual states, and the GPU
working memory: activation working memory AWM and model-state working memory MSWM),
sized the way this runtime allocates them:

Per GPU (the device layer's categories, `MEMORY_CATEGORIES`):
- parameter_slots: the slots the rank's program fills (slot_plan.py: a prefetch takes the
  free slot of lowest index), each as large as the largest backward stage it takes, at
  least two, in the working dtype;
- gradient_buffers: one buffer per backward stage whose gradients are in flight at once
  (the validator's peak) plus one, as large as the largest owned stage, in the main
  gradients' dtype (grad_host_bytes: what the offload copies as it is); when that is wider
  than the working dtype, also one micro-batch's gradients in the working dtype, which are
  added into the wide sum through a scratch of UPCAST_CHUNK elements at most
  (megatron/offload/grad_buffers.py);
- activation_checkpoints: checkpoints held at once (AFAB keeps every micro-batch's until
  its backward): the validator's residency bound plus the sent ones still in flight
  (`checkpoints_held`), each micro-batch x sequence x hidden;
- activations: AWM, what autograd saves while one backward stage is recomputed, plus the
  activation and gradient messages in flight;
  these two, the parameter slots and operator_working at the moment their sum peaks
  (`slots_checkpoints_and_activations`): the turn of an AFAB schedule, or a recompute
  with the checkpoints held while it runs;
- optimizer_subgroups: the device's share of the optimizer step, as the placement prices
  it (megatron/schedules/placement_cost.py): two subgroup slots (fp32 p, m, v, gradient
  and the 16-bit copy; SUBGROUP_SLOTS, for a stride and a GPU-heavy split alike) on ranks
  whose program updates subgroups on the device, sized as the runtime sizes them (a
  stage's largest group taken as the whole stage: an upper bound); or, for the static
  split, fp32 p, m, v and a gradient buffer per resident parameter;
- operator_working: MSWM beyond the slots and buffers: what the operators running at the
  moment the sum peaks hold beyond their inputs, outputs and saved tensors (measured on
  megatron-core's modules, tests/test_memory_model.py). A forward (no grad: the pass
  before the backward recomputes it) at the checkpoints' peak: a layer's most of SwiGLU's
  moment, its RMSNorm's and attention's (`attention_working_bytes`, by the kernel the
  runtime pins; with --attention-backend unfused plus the scores' buffer megatron-core
  keeps): SwiGLU, computed in place in fc1's output without grad (megatron.models.swiglu),
  holds fc1's output (2 x FFN per token) beside the residual and fc2's output (2 x FFN + 2 x
  hidden per token), or over pieces of the sequence where that exceeds attention's moment
  (`swiglu_chunks`: 2 x hidden + (2 x FFN + hidden) / pieces); the head its logits, their fp32
  copy and the loss's per-token temporaries. A backward stage's backward (its recompute
  holds less beyond what it saves): a layer's fc2 input gradient beside fc2's weight
  gradient (FFN x (tokens + hidden): autograd makes it before adding it into the
  gradient buffer) or the gate's and up's gradients (2 x FFN per token); the head the cast
  of the logits' gradient to the working dtype (or, in fp32, its input and weight
  gradients); the embedding its dense weight gradient. Not in the device layer's book.

Per node (host memory):
- shm_parameters: one segment per backward stage read or owned on the node (the working
  dtype, a header each): owned stages, and replicas of stages owned elsewhere;
- optimizer_states: master, m and v of every stage its ranks own (12 bytes/param in fp32;
  `optimizer_bytes`: 8 with bf16 m and v, 6 all in bf16); with the states on NVMe, the
  window instead: the stages the program holds read and not yet written at once (the
  validator's peak, each as large as the rank's largest stage) and one scratch chunk of
  STATE_SCRATCH_CHUNK elements that rollbacks, corrections and loads go through; plus the
  opt-in copies (`state_snapshots`): --optimizer-exact-rollback's step snapshot in host
  memory and --async-save's snapshot, each the owned states once more;
- host_gradients: the offloaded gradients of the owned stages (pooled, pinned on CUDA);
- process_baseline: the interpreter, torch and the CUDA context of each process.

No data parallelism exists yet, so nothing is divided by a data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.config.attention_kernel import (
    AttentionCall,
    attention_kernel,
    cpu_layer_gpu,
    kept_bytes,
)
from megatron.config.model import ModelConfig, materializes_attention_scores
from megatron.config.placement import DEFAULT_PLACEMENT, Placement

from .cost_model import backward_stage_params
from .hardware import HardwareProfile
from .instructions import WHOLE_STAGE, BackwardStage, Op, Schedule
from .partition import sub_stage_layers
from .placement_cost import RankOptimizer, device_optimizer_bytes
from .slot_plan import slot_elements_held, slot_numels
from .validator import ValidationReport, validate

# Elements widened to fp32 at a time, through one device scratch of that many: a
# micro-batch's 16-bit gradients added into their fp32 sum (megatron/offload/grad_buffers.py:
# converted into the scratch, then added, so that no operator makes a hidden fp32 copy of a
# whole stage), and an offload into a wider host dtype (grad_offload.py). 64 MiB of fp32.
UPCAST_CHUNK = 1 << 24
# Elements of a group that the NVMe tier's rollbacks, corrections and loads hold in host
# memory at a time (megatron/optimizer/disk_states.py's scratch buffer): 192 MiB of fp32
# p, m and v, against 12 bytes per parameter of a whole stage. A multiple of 4096 (O_DIRECT
# offsets stay aligned whatever the dtype).
STATE_SCRATCH_CHUNK = 1 << 24

GPU_TERMS = ("parameter_slots", "gradient_buffers", "activation_checkpoints", "activations",
             "optimizer_subgroups", "operator_working")
NODE_TERMS = ("shm_parameters", "optimizer_states", "host_gradients", "process_baseline")
SEGMENT_HEADER_BYTES = 4096  # megatron/offload/shm_header.py HEADER_BYTES
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq
FP32 = 4


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per term: `per_gpu[rank][term]`, `per_node[node][term]`."""

    per_gpu: tuple[dict[str, int], ...]
    per_node: tuple[dict[str, int], ...]
    per_process: tuple[dict[str, int], ...]  # each rank's share of the node's host terms
    procs_per_node: int
    # Optimizer states on NVMe: the state files' bytes per node (both versions); () when
    # the states are in host memory (optimizer_states then counts them, else the window).
    disk_per_node: tuple[int, ...] = ()

    @property
    def pinned_per_process(self) -> tuple[int, ...]:
        """Host bytes each process page-locks on CUDA: its pooled gradient buffers."""
        return tuple(p["host_gradients"] for p in self.per_process)

    def gpu_total(self, rank: int, measured_only: bool = False) -> int:
        # operator_working is transient inside an operator: not in the device layer's book
        terms = [t for t in GPU_TERMS if t != "operator_working"] if measured_only else GPU_TERMS
        return sum(self.per_gpu[rank][t] for t in terms)

    def node_total(self, node: int) -> int:
        return sum(self.per_node[node].values())


def layer_saved_bytes(model: ModelConfig, tokens: int, seq_length: int, itemsize: int) -> int:
    """What autograd saves for one decoder layer over `tokens` (micro-batch x sequence).

    Per token: each RMSNorm keeps its input and one fp32 scalar (megatron.models.rms_norm,
    alike on every device) and the linear after it its output; SwiGLU keeps gate, up,
    their product's input and fc2's input (4 x FFN); attention's output projection keeps
    its input. Per sequence:
    the rotary tables (4 x sequence x head dim). Core attention depends on its kernel: the
    unfused one (--attention-backend unfused) keeps Q, K and V (K and V expanded to all
    heads), the scores and the probabilities (heads x sequence each) and reads the causal
    mask (sequence^2 bytes); an SDPA kernel keeps what megatron.config.attention_kernel
    says it keeps, chosen by its rule for the GPU the CPU device layer plays (a fused one:
    Q, K and V of the query groups, its output, an fp32 log-sum-exp per head and a few
    bytes of RNG state; math: fp32 Q, K and V of every head and the probabilities twice).
    """
    h, ffn, heads = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    q_width = heads * model.head_dim
    fp32_per_token = 2
    working_per_token = 4 * h + q_width + 4 * ffn
    per_sequence = 4 * seq_length * (h // heads) * itemsize
    if materializes_attention_scores(model.attention_backend):
        working_per_token += 3 * q_width + 2 * heads * seq_length
        per_sequence += seq_length * seq_length
        core_attention = 0
    else:
        # fp16 takes the kernels bf16 takes from sm80 on (the CPU layer's GPU by default)
        call = AttentionCall("fp32" if itemsize == FP32 else "bf16", heads,
                             model.num_query_groups, model.head_dim, seq_length,
                             tokens // seq_length)
        core_attention = kept_bytes(attention_kernel(call, cpu_layer_gpu()), call)
    return (tokens * (fp32_per_token * FP32 + working_per_token * itemsize) + per_sequence
            + core_attention)


def head_saved_bytes(model: ModelConfig, tokens: int, itemsize: int) -> int:
    """Final norm (as in a layer: its input and one fp32 scalar), the output layer's input,
    fp32 logits, labels (int64), loss mask (bool) and per-token losses (fp32)."""
    vocab = model.planned_vocab_size
    return tokens * (FP32 + 2 * model.hidden_size * itemsize
                     + vocab * FP32 + 8 + 1 + FP32) + FP32


def embedding_saved_bytes(tokens: int) -> int:
    return tokens * 8  # the token ids (int64)


# Bytes per token megatron-core's vocab-parallel cross-entropy allocates beside the logits:
# the labels, their masks, gathered logits and per-token fp32 results (measured 37 without
# grad, 28 with).
LOSS_TOKEN_BYTES = 40


@dataclass(frozen=True)
class Working:
    """Operator working memory of a piece: the most its forward without grad holds beyond
    its input and output, and the most its backward holds beyond what it held before (its
    saved tensors, the output's gradient; the weights' gradients are added into the
    gradient buffer in place, each made first)."""

    forward: int
    backward: int


def layer_working_bytes(model: ModelConfig, tokens: int, seq_length: int, itemsize: int
                        ) -> Working:
    """A decoder layer's: the no-grad forward's most, of attention's moment, the RMSNorm's
    (megatron.models.rms_norm: in half precision the fp32 input beside its squares, 8 x
    hidden bytes per token; in fp32 the product, 4 x hidden; and the fp32 scalar) and
    SwiGLU's; the backward's, SwiGLU's or unfused attention's softmax
    backward; both plus the scores' scratch megatron-core's unfused attention keeps between
    calls (see the module docstring)."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    swiglu = swiglu_working_bytes(model, tokens, seq_length, itemsize,
                                  swiglu_chunks(model, tokens, seq_length, itemsize))
    norm = tokens * ((8 if itemsize != FP32 else 4) * h + FP32)
    forward = max(swiglu, norm, attention_working_bytes(model, tokens, seq_length, itemsize))
    scratch = unfused_scores_scratch_bytes(model, tokens, seq_length, itemsize)
    swiglu_backward = max(ffn * (tokens + h), 2 * tokens * ffn) * itemsize
    # unfused attention's softmax backward holds the fp32 gradients of the probabilities
    # and of the scores at once: 8 bytes per score, an upper bound (what autograd has freed
    # of the saved tensors by then is not subtracted)
    softmax_backward = 8 * scratch // itemsize
    return Working(forward + scratch, max(swiglu_backward, softmax_backward) + scratch)


def swiglu_working_bytes(model: ModelConfig, tokens: int, seq_length: int, itemsize: int,
                         chunks: int) -> int:
    """The no-grad SwiGLU MLP's moment, in place in fc1's output (megatron.models.swiglu)
    over `chunks` pieces of the sequence: in one, fc1's output (2 x FFN per token) beside
    the residual and fc2's output (2 x FFN + 2 x hidden per token); in several, the
    layer's output and the residual beside one piece's fc1 output and fc2 output (its
    rows, copied into the layer's output)."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    if chunks == 1:
        return tokens * (2 * ffn + 2 * h) * itemsize
    piece = -(-seq_length // chunks) * (tokens // seq_length)
    return (2 * h * tokens + (2 * ffn + h) * piece) * itemsize


def swiglu_chunks(model: ModelConfig, tokens: int, seq_length: int, itemsize: int) -> int:
    """How many pieces of the sequence the no-grad SwiGLU MLP runs over: one where its
    moment is no larger than attention's (the kernel the default --attention-backend pins),
    else the fewest that make it so (at most one position each). A GEMM over fewer rows
    may pick another kernel on CUDA, so one piece wherever memory allows. One rule for the
    runtime (megatron.models.swiglu) and this model."""
    bound = attention_working_bytes(replace(model, attention_backend="auto"), tokens,
                                    seq_length, itemsize)
    for chunks in range(1, seq_length + 1):
        if swiglu_working_bytes(model, tokens, seq_length, itemsize, chunks) <= bound:
            return chunks
    return seq_length


def unfused_scores_scratch_bytes(model: ModelConfig, tokens: int, seq_length: int,
                                 itemsize: int) -> int:
    """megatron-core's unfused attention computes the scores into a buffer of its global
    memory buffer, kept between calls as large as the largest scores: held all along."""
    if not materializes_attention_scores(model.attention_backend):
        return 0
    return tokens * model.num_attention_heads * seq_length * itemsize


# The RNG state a fused kernel returns beside its output (flash: two uint64 and one more;
# the others a philox seed and offset, int64 each): the larger.
KERNEL_RNG_BYTES = 24


def attention_working_bytes(model: ModelConfig, tokens: int, seq_length: int, itemsize: int
                            ) -> int:
    """The most a layer's no-grad forward holds, beyond its input and output, up to the
    output projection, with the core-attention kernel the runtime picks (megatron.config.
    attention_kernel's rule, for the GPU the CPU device layer plays, or --attention-backend
    unfused).

    Held throughout, per token: the norm's output, the fused QKV projection and a
    contiguous copy of the queries with grouped-query attention (of more than one group),
    rotated in place
    (megatron.models.rope). RoPE holds, while it rotates the queries, two half-size
    products (the queries' size) beside the cosine and sine tables. Then the kernel's
    moment: a fused kernel's output, its fp32 log-sum-exp per head and, where flash pads the
    head dimension to a multiple of 8, the padded inputs (the sliced output is then copied
    to [sequence, batch, hidden]), or the output projection's output beside its input;
    math's fp32 scaled query, keys and values expanded to every head and scaled keys, the
    causal mask in fp32, the scores and the masked scores (half inputs upcast first);
    megatron-core's unfused DotProductAttention (keys and values expanded to every head)
    the scores and probabilities, in half precision with their fp32 copies inside the
    softmax, then beside the context and its contiguous copy. Less the layer's output
    (hidden per token), as SwiGLU's moment counts it."""
    h, heads, groups, d = (model.hidden_size, model.num_attention_heads,
                           model.num_query_groups, model.head_dim)
    q, kv = heads * d, groups * d
    grouped = groups != heads
    batch = tokens // seq_length
    scores = batch * heads * seq_length * seq_length  # elements
    half = itemsize != FP32
    call = AttentionCall("fp32" if not half else "bf16", heads, groups, d, seq_length, batch)
    kernel = attention_kernel(call, cpu_layer_gpu(), model.attention_backend)
    # the queries' reshape copies them where groups hold several heads each; with one group
    # it is a view, which megatron-core's unfused attention then copies into [seq, b x heads]
    query_copy = q if grouped and (groups > 1 or kernel == "unfused") else 0
    projected = tokens * (h + q + 2 * kv + query_copy) * itemsize
    tables = 2 * seq_length * d * itemsize
    # RoPE rotates in place without grad (megatron.models.rope): two half-size products
    rotary = projected + q * tokens * itemsize + tables
    held = projected
    if kernel == "unfused":
        expanded = 2 * q * tokens * itemsize if grouped else 0
        moment = (expanded + 2 * scores * itemsize
                  + max(8 * scores if half else 0, 2 * q * tokens * itemsize))
    elif kernel == "math":
        upcast = tokens * (q + 2 * kv) * FP32 if half else 0
        moment = upcast + seq_length * seq_length * FP32 + max(
            (4 * q * tokens + scores) * FP32, (3 * q * tokens + 2 * scores) * FP32)
    else:
        padded = -(-d // 8) * 8 if kernel == "flash" else d
        pad = padded != d
        q_padded, kv_padded = heads * padded, groups * padded
        moment = max(tokens * (heads * FP32 + (q_padded + (q_padded + 2 * kv_padded) * pad)
                               * itemsize),
                     tokens * (q_padded + q) * itemsize * pad,
                     tokens * (q + h) * itemsize) + KERNEL_RNG_BYTES
    return max(rotary, held + moment) - tokens * h * itemsize


def head_working_bytes(model: ModelConfig, tokens: int, itemsize: int) -> Working:
    """The head's: the logits beside the final norm's output, or beside their fp32 copy and
    the loss's temporaries (the copy is the logits themselves in fp32); in the backward the
    logits again while recomputing, the cast of the logits' gradient, or the output layer's
    input and weight gradients once the fp32 gradient is gone."""
    h, vocab = model.hidden_size, model.planned_vocab_size
    upcast = tokens * vocab * FP32 if itemsize != FP32 else 0
    forward = max(tokens * (vocab + h) * itemsize,
                  tokens * (vocab * itemsize + LOSS_TOKEN_BYTES) + upcast)
    cast = tokens * vocab * itemsize if itemsize != FP32 else 0
    # recomputing, the logits in the working dtype are not saved (their fp32 copy is)
    recompute = tokens * (vocab * itemsize + LOSS_TOKEN_BYTES) if upcast else 0
    backward = max(recompute, cast, cast - upcast + (tokens + vocab) * h * itemsize)
    return Working(forward, backward)


def embedding_working_bytes(model: ModelConfig, tokens: int, itemsize: int) -> Working:
    """The embedding's: the looked-up rows before their transposed copy; in the backward
    the weight's gradient, made dense (vocabulary x hidden)."""
    h = model.hidden_size
    return Working(tokens * h * itemsize, model.planned_vocab_size * h * itemsize)


def backward_stage_working_bytes(model: ModelConfig, partition: tuple[int, ...],
                                 backward_split: int, tokens: int, seq_length: int,
                                 itemsize: int) -> dict[BackwardStage, Working]:
    """Operator working memory of every backward stage: the most of its pieces'."""
    layer = layer_working_bytes(model, tokens, seq_length, itemsize)
    head = head_working_bytes(model, tokens, itemsize)
    embedding = embedding_working_bytes(model, tokens, itemsize)
    out = {}
    for b, r in sub_stage_layers(partition, backward_split).items():
        pieces = ([layer] if r.count else []) + ([head] if r.has_head else []) + (
            [embedding] if r.has_embedding else [])
        out[BackwardStage(*b)] = Working(max((p.forward for p in pieces), default=0),
                                         max((p.backward for p in pieces), default=0))
    return out


def backward_stage_saved_bytes(model: ModelConfig, partition: tuple[int, ...], backward_split: int,
                               micro_batch_size: int, seq_length: int, itemsize: int
                               ) -> dict[BackwardStage, int]:
    """AWM of every backward stage: what its recompute saves for one micro-batch."""
    tokens = micro_batch_size * seq_length
    layer = layer_saved_bytes(model, tokens, seq_length, itemsize)
    return {
        BackwardStage(*b): (r.count * layer
                            + (embedding_saved_bytes(tokens) if r.has_embedding else 0)
                            + (head_saved_bytes(model, tokens, itemsize) if r.has_head else 0))
        for b, r in sub_stage_layers(partition, backward_split).items()
    }


def _stages_used(schedule: Schedule, rank: int) -> set[BackwardStage]:
    used = {b for i in range(schedule.forward_stages) if schedule.forward_rank[i] == rank
            for b in schedule.params_of(i, WHOLE_STAGE)}
    return used | set(schedule.owned_by(rank))


def _program(schedule: Schedule, rank: int) -> tuple:
    return schedule.programs[rank] if schedule.programs else ()  # a shape has none yet


def _stages_read(schedule: Schedule, rank: int) -> set[BackwardStage]:
    return {b for ins in _program(schedule, rank) if ins.op == Op.PREFETCH_PARAMS
            for b in schedule.params_of(ins.stage, ins.sub)}


def _stages_updating_subgroups(schedule: Schedule, rank: int) -> set[BackwardStage]:
    return {BackwardStage(ins.stage, ins.sub) for ins in _program(schedule, rank)
            if ins.op == Op.OPTIMIZER_START_SUBGROUPS}


def checkpoints_held(schedule: Schedule, rank: int,
                     report: ValidationReport | None = None) -> int:
    """Activation checkpoints the runtime holds at most on `rank`, in checkpoints, where a
    send is known complete when it is (NCCL: the executor queries it after every
    instruction).

    The validator's residency bound: a checkpoint is held from its forward (or from the
    posting of its receive) until its backward has used it. A sent one is dropped when its
    isend completes rather than at the ISEND_CKPT itself; the receiver posts its receive
    early, so one send in flight is allowed for.
    """
    report = report if report is not None else validate(schedule)
    sends = any(ins.op == Op.ISEND_CKPT for ins in _program(schedule, rank))
    return report.peak_checkpoints[rank] + int(sends)


def slots_checkpoints_and_activations(schedule: Schedule, rank: int, sizes: _Sizes,
                                      report: ValidationReport, numels: tuple[int, ...],
                                      param_bytes: int, sends_complete: bool = True
                                      ) -> tuple[int, int, int, int]:
    """Bytes of parameter slots, activation checkpoints, activations and operator working
    memory `rank` holds when their sum peaks (`numels`: its slots' elements, all allocated
    at the start).

    They peak at different moments, so their peaks are not added: the checkpoints' own
    peak falls between instructions (an AFAB schedule's turn, every micro-batch's held,
    the last forward's not yet sent), with the activation and gradient messages the
    validator finds held then and every slot counted; a backward's recompute adds what
    it saves (the stage's AWM, its checkpoint among it: autograd keeps the stage's input)
    to the checkpoints held while it runs and to the slots still allocated then (a slot
    the program fills no more is given back at its last release, slot_plan.slots_given_back:
    the forward's, idle in the backward). `sends_complete`: a sent checkpoint is dropped
    once its send completes, one in flight allowed for (`checkpoints_held`); False: the
    backend reports a send complete only when it is waited for, at the iteration's end
    (gloo, the CPU device layer), so every checkpoint sent so far is still held.
    Operators add their working memory: at the checkpoints' peak a forward's (no grad,
    the largest of the rank's forward stages: a forward runs with at most that many
    checkpoints held), at a backward the stage's backward's.
    """
    messages = 2 * sizes.message
    if sends_complete or not report.peak_checkpoints_sent:
        peak = checkpoints_held(schedule, rank, report)
        sends = peak - report.peak_checkpoints[rank]
        in_backward = {b: n + sends for b, n in (report.checkpoints_in_backward[rank]
                                                 if report.checkpoints_in_backward else {}
                                                 ).items()}
        at_peak = report.messages_at_peak[rank] if report.messages_at_peak else 0
    else:
        peak = report.peak_checkpoints_sent[rank]
        in_backward = report.checkpoints_in_backward_sent[rank]
        at_peak = report.messages_at_peak_sent[rank]
    slot_bytes = sum(numels) * param_bytes
    slots_at = _slot_bytes_at_backwards(schedule, rank, numels, param_bytes)
    forward = max((sizes.working[b].forward for i in range(schedule.forward_stages)
                   if schedule.forward_rank[i] == rank
                   for b in schedule.params_of(i, WHOLE_STAGE)), default=0)
    moments = [(slot_bytes, peak * sizes.message, at_peak * sizes.message, forward)]
    # without a program (a shape): at least the slot holding the stage being recomputed
    moments += [(slots_at.get(b, sizes.params[b] * param_bytes),
                 in_backward.get(b, peak) * sizes.message, sizes.saved[b] + messages,
                 sizes.working[b].backward)
                for b in schedule.owned_by(rank)]
    return max(moments, key=sum)


def _slot_bytes_at_backwards(schedule: Schedule, rank: int, numels: tuple[int, ...],
                             param_bytes: int) -> dict[BackwardStage, int]:
    """Slot bytes still allocated at each backward stage's first backward on `rank` (the
    most its backwards see: slots are only given back within a program)."""
    program = _program(schedule, rank)
    held = slot_elements_held(schedule, rank, numels) if program else []
    at: dict[BackwardStage, int] = {}
    for index, ins in enumerate(program):
        if ins.op == Op.BACKWARD:
            at.setdefault(BackwardStage(ins.stage, ins.sub), held[index] * param_bytes)
    return at


def shape_report(schedule: Schedule) -> ValidationReport:
    """Peaks of zero for a schedule's shape (build_schedule(..., lower=False)): plan_memory
    with it gives a lower bound of every term before the programs exist (the slots,
    checkpoints and activations together: two parameter slots, or the one of a stage being
    recomputed, no checkpoint; one gradient buffer; /dev/shm counts the owned stages only), so
    a planner can drop what cannot fit without building it."""
    zeros = (0,) * schedule.ranks
    return ValidationReport(instructions=zeros, peak_params=zeros, peak_checkpoints=zeros,
                            peak_gradients=zeros)


@dataclass(frozen=True)
class MemoryShape:
    """What the memory model prices of a run besides its schedule and its optimizer's
    placement: the model, one micro-batch, the precisions and the ranks per node."""

    model: ModelConfig
    micro_batch_size: int
    seq_length: int | None = None  # None: the model's
    param_bytes: int = 2  # the working dtype's size (2 for bf16/fp16, 4 for fp32)
    # the main gradients' (megatron.config.run.host_gradient_dtype): summed over the
    # micro-batches on the device and offloaded in it (4 unless Megatron-LM's flags say 2)
    grad_host_bytes: int = 4
    # host bytes per parameter of the master and Adam's moments (12 in fp32, 8 with bf16
    # m and v, 6 all in bf16)
    optimizer_bytes: int = OPTIMIZER_BYTES_PER_PARAM
    procs_per_node: int | None = None  # None: all ranks on one node
    # Copies of the owned states kept beside them in host memory, each as large: the step
    # snapshot of --optimizer-exact-rollback (states in host memory) and --async-save's
    state_snapshots: int = 0
    # Whether the backend reports a checkpoint's send complete when it is (NCCL, CUDA);
    # gloo (the CPU device layer) does only when it is waited for, at the iteration's end
    sends_complete: bool = True


@dataclass(frozen=True)
class _Sizes:
    """The schedule's sizes every term is made of."""

    params: dict[BackwardStage, int]  # of each backward stage
    saved: dict[BackwardStage, int]  # AWM of each backward stage
    working: dict[BackwardStage, Working]  # operator working memory of each backward stage
    tokens: int  # of one micro-batch
    message: int  # bytes of one activation, gradient or checkpoint

    @classmethod
    def of(cls, schedule: Schedule, shape: MemoryShape) -> _Sizes:
        model, seq = shape.model, shape.seq_length or shape.model.seq_length
        tokens = shape.micro_batch_size * seq
        return cls(backward_stage_params(model, schedule.partition, schedule.backward_split),
                   backward_stage_saved_bytes(model, schedule.partition,
                                              schedule.backward_split, shape.micro_batch_size,
                                              seq, shape.param_bytes),
                   backward_stage_working_bytes(model, schedule.partition,
                                                schedule.backward_split, tokens, seq,
                                                shape.param_bytes),
                   tokens, tokens * model.hidden_size * shape.param_bytes)


def plan_memory(schedule: Schedule, shape: MemoryShape, placement: Placement = DEFAULT_PLACEMENT,
                hardware: HardwareProfile | None = None,
                report: ValidationReport | None = None) -> MemoryPlan:
    """The memory `schedule` needs for `shape` with the optimizer placed by `placement`
    (see the module docstring); `report`: the schedule's validation, when already done."""
    report = report if report is not None else validate(schedule)
    sizes = _Sizes.of(schedule, shape)
    per_gpu = tuple(_gpu_terms(schedule, rank, shape, sizes, placement, report)
                    for rank in range(schedule.ranks))
    per_process = tuple(_host_terms(schedule, rank, shape, sizes, report)
                        for rank in range(schedule.ranks))
    per_node_procs = shape.procs_per_node or schedule.ranks
    nodes = [range(first, min(schedule.ranks, first + per_node_procs))
             for first in range(0, schedule.ranks, per_node_procs)]
    baseline = hardware.process_baseline_bytes if hardware is not None else 0
    per_node = tuple(_node_terms(schedule, ranks, shape, sizes, per_process, baseline)
                     for ranks in nodes)
    disk = ()
    if report.peak_optimizer_states:  # the committed and the staged version of each state
        disk = tuple(2 * shape.optimizer_bytes * sum(sizes.params[b] for rank in ranks
                                                     for b in schedule.owned_by(rank))
                     for ranks in nodes)
    return MemoryPlan(per_gpu, per_node, per_process, per_node_procs, disk)


def _gpu_terms(schedule: Schedule, rank: int, shape: MemoryShape, sizes: _Sizes,
               placement: Placement, report: ValidationReport) -> dict[str, int]:
    params, param_bytes = sizes.params, shape.param_bytes
    owned = schedule.owned_by(rank)
    largest_owned = max((params[b] for b in owned), default=0)
    buffers = min(report.peak_gradients[rank] + 1, max(1, len(owned))) if owned else 0
    micro_batch = (largest_owned * param_bytes
                   + min(largest_owned, UPCAST_CHUNK) * shape.grad_host_bytes
                   if shape.grad_host_bytes != param_bytes and largest_owned else 0)
    gradient_buffers = buffers * largest_owned * shape.grad_host_bytes + micro_batch
    optimizer = RankOptimizer(
        sum(params[b] for b in owned),
        tuple(params[b] for b in _stages_updating_subgroups(schedule, rank)),
        gradient_buffers, param_bytes, placement.subgroup_size)
    used = {b: params[b] for b in _stages_used(schedule, rank)}
    return {
        "gradient_buffers": gradient_buffers,
        "optimizer_subgroups": device_optimizer_bytes(placement.updates, optimizer),
        **dict(zip(("parameter_slots", "activation_checkpoints", "activations",
                    "operator_working"),
                   slots_checkpoints_and_activations(
                       schedule, rank, sizes, report, slot_numels([schedule], rank, used),
                       param_bytes, shape.sends_complete))),
    }


def _host_terms(schedule: Schedule, rank: int, shape: MemoryShape, sizes: _Sizes,
                report: ValidationReport) -> dict[str, int]:
    """The rank's optimizer states and offloaded gradients in host memory."""
    owned = [sizes.params[b] for b in schedule.owned_by(rank)]
    states = shape.optimizer_bytes * sum(owned)
    if report.peak_optimizer_states:  # on NVMe: the program's window (stages read and not
        window = max(1, report.peak_optimizer_states[rank])  # yet written, a stage each at
        largest = max(owned, default=0)  # most) and the scratch chunk
        states = min(states, shape.optimizer_bytes
                     * (window * largest + min(STATE_SCRATCH_CHUNK, largest)))
    states += shape.state_snapshots * shape.optimizer_bytes * sum(owned)
    return {"optimizer_states": states, "host_gradients": shape.grad_host_bytes * sum(owned)}


def _node_terms(schedule: Schedule, ranks: range, shape: MemoryShape, sizes: _Sizes,
                per_process: tuple[dict[str, int], ...], baseline: int) -> dict[str, int]:
    segments = set()
    for rank in ranks:
        segments |= _stages_read(schedule, rank) | set(schedule.owned_by(rank))
    return {
        "shm_parameters": sum(SEGMENT_HEADER_BYTES + sizes.params[b] * shape.param_bytes
                              for b in segments),
        **{term: sum(per_process[rank][term] for rank in ranks)
           for term in ("optimizer_states", "host_gradients")},
        "process_baseline": baseline * len(ranks),
    }


@dataclass(frozen=True)
class Shortfall:
    """A resource that does not fit: what is needed and what there is, in bytes."""

    resource: str  # "gpu memory", "host memory", "/dev/shm"
    where: str  # "rank 3", "node 1"
    needed: int
    available: int

    @property
    def missing(self) -> int:
        return self.needed - self.available


def host_need(plan: MemoryPlan, node: int, hardware: HardwareProfile) -> int:
    """The node's host memory; on the CPU device layer its ranks' "GPU" memory is host too."""
    need = plan.node_total(node)
    if hardware.device_kind == "cpu":
        first = node * plan.procs_per_node
        need += sum(plan.gpu_total(r) for r in range(first, min(first + plan.procs_per_node,
                                                                  len(plan.per_gpu))))
    return need


def pinning_shortfall(plan: MemoryPlan, hardware: HardwareProfile) -> int:
    """Bytes by which the largest process's pinned gradient buffers exceed ulimit -l (0: none).
    Not a failure: the pool then falls back to pageable memory, slower copies."""
    if hardware.device_kind != "cuda" or hardware.memlock_bytes is None:
        return 0
    return max(0, max(plan.pinned_per_process, default=0) - hardware.memlock_bytes)


RESOURCE_ORDER = ("host memory", "/dev/shm", "nvme", "gpu memory")  # per node first


def shortfalls(plan: MemoryPlan, hardware: HardwareProfile) -> list[Shortfall]:
    """Every resource of `hardware` that `plan` exceeds: the per-node ones first (only more
    nodes help), then GPU memory; the worst first within each kind."""
    found = []
    gpu_free = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes
    for rank in range(len(plan.per_gpu)):
        if hardware.gpu_memory_bytes and plan.gpu_total(rank) > gpu_free:
            found.append(Shortfall("gpu memory", f"rank {rank}", plan.gpu_total(rank), gpu_free))
    for node, terms in enumerate(plan.per_node):
        host = host_need(plan, node, hardware)
        if hardware.host_memory_bytes and host > hardware.host_memory_bytes:
            found.append(Shortfall("host memory", f"node {node}", host,
                                   hardware.host_memory_bytes))
        if hardware.shm_bytes and terms["shm_parameters"] > hardware.shm_bytes:
            found.append(Shortfall("/dev/shm", f"node {node}", terms["shm_parameters"],
                                   hardware.shm_bytes))
        if plan.disk_per_node and plan.disk_per_node[node] > hardware.nvme_capacity_bytes:
            found.append(Shortfall("nvme", f"node {node}", plan.disk_per_node[node],
                                   hardware.nvme_capacity_bytes))
    return sorted(found, key=lambda s: (RESOURCE_ORDER.index(s.resource), -s.missing))


SINGLE_PROCESS_TERMS = ("parameters", "gradients", "optimizer_states", "activations",
                        "operator_working")


def single_process_memory(model: ModelConfig, micro_batch_size: int, seq_length: int,
                          itemsize: int) -> dict[str, int]:
    """What the one-process reference (training/local_step.py) allocates, per term: the
    whole model in the working dtype plus fp32 masters (built in fp32 first: at least 8
    bytes per parameter at start), the working and the fp32 master gradients, torch AdamW's
    two fp32 moments, what autograd saves over one micro-batch with no recompute (every
    layer, the head and the embedding), and the logits' gradient."""
    params = model.parameters().total
    tokens = micro_batch_size * seq_length
    return {
        "parameters": params * (max(itemsize, FP32) + FP32),
        "gradients": params * (itemsize + FP32),
        "optimizer_states": params * 2 * FP32,
        "activations": (model.num_layers * layer_saved_bytes(model, tokens, seq_length, itemsize)
                        + head_saved_bytes(model, tokens, itemsize)
                        + embedding_saved_bytes(tokens)),
        "operator_working": tokens * model.planned_vocab_size * FP32,
    }
