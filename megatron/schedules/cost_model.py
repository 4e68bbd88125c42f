"""Cost models for the pipeline simulator: abstract units or a model (or preset) on hardware.

All times are per micro-batch for compute and per iteration for parameter/gradient
transfers and optimizer steps. A backward stage (i, k) of a forward stage split d ways
costs 1/d of the forward stage's backward, recompute, optimizer and transfer figures in
the abstract model, and its share of the layers in the derived one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.config.model import ModelConfig
from megatron.config.presets import get_preset

from .hardware import HardwareProfile, get_hardware
from .instructions import BackwardStage, Schedule
from .optimizer_stride import UpdateRates
from .partition import balanced_partition, sub_stage_layers


@dataclass(frozen=True)
class CostModel:
    """Per-stage and per-backward-stage costs for one schedule's shape."""

    forward: tuple[float, ...]  # per forward stage, per micro-batch
    backward: dict[BackwardStage, float]  # per backward stage, per micro-batch, without recompute
    recompute: dict[BackwardStage, float]  # per backward stage, per micro-batch
    optimizer: dict[BackwardStage, float]  # CPU optimizer step of a backward stage
    param_transfer: dict[BackwardStage, float]  # host -> device copy of a backward stage's parameters
    grad_transfer: dict[BackwardStage, float]  # device -> host copy of its gradients
    p2p_activation: float = 0.0  # one activation or gradient between ranks
    p2p_checkpoint: float = 0.0  # one activation checkpoint between ranks
    rollback: float = 0.0  # expected corrections per iteration and rank (0: no overflow)
    # host seconds of every instruction beyond its compute and transfer (the executor's
    # dispatch), each kind alike, on the issuing rank's clock before it takes effect
    instruction: float = 0.0
    # OPTIMIZER_START_SUBGROUPS: how the device part of a stage's update is priced (None:
    # the instruction costs what OPTIMIZER_START does)
    device_update: DeviceUpdateCosts | None = None
    # a backward stage's 16-bit parameters from its owner's node to another node (empty:
    # no inter-node link is priced; see distribution.py)
    inter_node_transfer: dict[BackwardStage, float] = field(default_factory=dict)
    # Optimizer states on NVMe: what READ/WRITE_OPTIMIZER_STATES cost (None: in host memory)
    disk: DiskCosts | None = None
    # The share of its rank's CPU rate (`optimizer` prices the full rate) that one update
    # reaches while no other update of the rank runs beside it (1: any update alone uses
    # the whole; see HardwareProfile.single_update_share)
    single_update_share: float = 1.0


@dataclass(frozen=True)
class DiskCosts:
    """Seconds to read / write a backward stage's optimizer state (master, m, v) on the
    drive that `ranks_per_node` consecutive ranks share."""

    read: dict[BackwardStage, float]
    write: dict[BackwardStage, float]
    ranks_per_node: int


@dataclass(frozen=True)
class DeviceUpdateCosts:
    """The subgroups of a stage that the split `stride` places on the device (every K-th,
    or -N: all but every N-th; see optimizer_stride.py) (Deep Optimizer States): their
    fp32 p, m, v move in and out at `rates.h2d_params_per_s` each way and are updated at
    `rates.gpu_update_params_per_s`; the CPU updates the rest at the CostModel's rate."""

    stride: int
    params: dict[BackwardStage, int]
    rates: UpdateRates


def uniform_costs(
    schedule: Schedule,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    recompute_time: float = 0.0,
    optimizer_time: float = 0.0,
    param_transfer_time: float = 0.0,
    grad_transfer_time: float = 0.0,
    p2p_time: float = 0.0,
    inter_node_time: float = 0.0,
) -> CostModel:
    """Abstract units per forward stage (the paper's simplified figures by default)."""
    values = {
        "forward_time": forward_time, "backward_time": backward_time,
        "recompute_time": recompute_time, "optimizer_time": optimizer_time,
        "param_transfer_time": param_transfer_time, "grad_transfer_time": grad_transfer_time,
        "p2p_time": p2p_time, "inter_node_time": inter_node_time,
    }
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} is {value!r}, expected a number >= 0")
    if forward_time <= 0:
        raise ValueError(f"forward_time is {forward_time!r}, expected a number > 0")
    d = schedule.backward_split
    pieces = schedule.backward_stages()

    def share(value: float) -> dict[BackwardStage, float]:
        return {piece: value / d for piece in pieces}

    return CostModel(
        forward=(forward_time,) * schedule.forward_stages,
        backward=share(backward_time),
        recompute=share(recompute_time),
        optimizer=share(optimizer_time),
        param_transfer=share(param_transfer_time),
        grad_transfer=share(grad_transfer_time),
        p2p_activation=p2p_time,
        p2p_checkpoint=p2p_time,
        inter_node_transfer=share(inter_node_time) if inter_node_time else {},
    )


def iteration_lower_bound(schedule: Schedule, costs: CostModel, cpu_share: float = 1.0,
                          steps_after_all_compute: bool = False) -> float:
    """A time no simulation of this shape goes under, from the assignment alone (the
    programs are not needed). Every rank: it cannot compute before the forward stages ahead
    of its first stage have run once for a micro-batch; it then runs its own forwards and
    backwards, every micro-batch, one at a time; after its last compute, that micro-batch's
    backward still passes through every stage below, one after the other, or, when the last
    compute is a backward, that stage's CPU update runs (its CPU lane runs them one at a
    time too). `cpu_share`: the least part of an update left on the CPU (1 - 1/k with device
    subgroups every k-th); `steps_after_all_compute`: the programs start the updates after a
    collective that follows every rank's compute (the synchronous optimizer)."""
    ahead = [0.0]
    for t in costs.forward:
        ahead.append(ahead[-1] + t)
    behind: dict[BackwardStage, float] = {}  # a micro-batch's backward after this stage's
    below = 0.0
    for b in sorted(schedule.backward_stages()):
        behind[b] = below
        below += costs.backward[b] + costs.recompute[b]
    compute_end, updates = 0.0, 0.0
    for rank in range(schedule.ranks):
        forwards = [i for i, r in enumerate(schedule.forward_rank) if r == rank]
        owned = schedule.owned_by(rank)
        if not forwards and not owned:
            continue
        work = (sum(costs.forward[i] for i in forwards)
                + sum(costs.backward[b] + costs.recompute[b] for b in owned))
        start = ahead[min([*forwards, *(b.stage for b in owned)])]
        after = min([*(behind[BackwardStage(i, 0)] for i in forwards),
                     *(max(behind[b], cpu_share * costs.optimizer[b]) for b in owned)])
        compute_end = max(compute_end, start + schedule.micro_batches * work + after)
        cpu = cpu_share * sum(costs.optimizer[b] for b in owned)
        updates = max(updates, cpu)
        compute_end = max(compute_end, start + cpu)
    return compute_end + updates if steps_after_all_compute else compute_end


def layer_forward_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """2 flops per weight plus attention scores and weighted sum (4 * s * h)."""
    per_layer = model.parameters().per_layer
    return 2.0 * per_layer + 4.0 * seq_length * model.hidden_size


def head_forward_flops_per_token(model: ModelConfig) -> float:
    return 2.0 * model.hidden_size * (model.planned_vocab_size)


def megatron_model_flops_per_token(model: ModelConfig) -> float:
    """Megatron-LM 0.19's model FLOPs per token (num_floating_point_operations of a dense
    GPT with SwiGLU and grouped-query attention, over batch x seq_length tokens): 3 passes
    (forward, data and weight gradients) x 2 flops per multiply-add of each projection
    (queries heads x kv_channels wide), of the attention scores and their product with the
    values (halved by the causal mask) and of the logits; no norms, no embedding lookup,
    recomputation not counted. The FLOPs of --log-throughput, of the checkpoint's
    num_floating_point_operations_so_far and of --plan's MFU. (The cost model prices the
    passes with layer_forward_flops_per_token, the profiles' own measure.)"""
    h, s = model.hidden_size, model.seq_length
    queries = model.num_attention_heads * model.head_dim
    keys_values = 2 * model.num_query_groups * model.head_dim
    projections = h * (queries + keys_values) + queries * h + 3 * h * model.ffn_hidden_size
    core_attention = 2 * s * queries / 2  # QK^T and (QK^T)V, causal
    return 3 * 2 * (model.num_layers * (projections + core_attention)
                    + h * model.planned_vocab_size)


def derived_costs(
    schedule: Schedule,
    model: ModelConfig | str,
    hardware: HardwareProfile | str,
    micro_batch_size: int,
    seq_length: int | None = None,
    optimizer_bytes: int = 12,
    grad_bytes: int = 2,
) -> CostModel:
    """Costs of `model` on `hardware` for the schedule's partition (layers per stage).

    A decoder layer's forward is its flops at the profile's efficiency curve at the
    micro-batch's tokens, the head's its flops at `head_rate_over_layer` times that rate;
    backward is the profile's `backward_over_forward` times the forward (2 unless
    measured; the head's `head_backward_over_forward` where measured), recompute equals
    the forward, every pass scaled by `executor_compute_over_pass` (the executor's
    instructions against the passes alone); parameters move in 16-bit, gradients in
    `grad_bytes` per parameter (a run's main gradients: 4 for --bf16 by Megatron-LM's rule,
    2 with --grad-reduce-in-bf16 and in the papers' designs, this default); the CPU
    optimizer throughput of a node is shared by its GPUs; every
    forward and backward pass adds the profile's `pass_overhead_s`, every transfer between
    ranks (activation, gradient, checkpoint) its `p2p_latency_s`, every instruction (those
    included) its `instruction_overhead_s`; one update alone reaches the profile's
    `single_update_share` of its rank's CPU rate. A schedule with
    READ/WRITE_OPTIMIZER_STATES reads and writes `optimizer_bytes` per parameter on the
    node's drives.
    """
    model = get_preset(model) if isinstance(model, str) else model
    hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size is {micro_batch_size}, expected >= 1")
    if sum(schedule.partition) != model.num_layers:
        raise ValueError(
            f"partition has {sum(schedule.partition)} layers, model {model.name} has "
            f"{model.num_layers}"
        )
    seq = seq_length or model.seq_length
    tokens = micro_batch_size * seq
    efficiency = hardware.gpu_max_efficiency * tokens / (tokens + hardware.efficiency_half_tokens)
    flops_per_s = hardware.gpu_peak_flops * efficiency
    # a pass as the executor's instructions deliver it (executor_compute_over_pass)
    layer_time = (layer_forward_flops_per_token(model, seq) * tokens / flops_per_s
                  * hardware.executor_compute_over_pass)
    # the head at its own rate, a fixed ratio to the layer's at these tokens
    head_time = (head_forward_flops_per_token(model) * tokens
                 / (flops_per_s * hardware.head_rate_over_layer)
                 * hardware.executor_compute_over_pass)
    head_backward = (hardware.backward_over_forward if hardware.head_backward_over_forward
                     is None else hardware.head_backward_over_forward)
    optimizer_rate = hardware.cpu_optimizer_params_per_s / hardware.gpus_per_node

    params = backward_stage_params(model, schedule.partition, schedule.backward_split)
    pieces = sub_stage_layers(schedule.partition, schedule.backward_split)
    forward_piece = {
        BackwardStage(*b): layers.count * layer_time + (head_time if layers.has_head else 0.0)
        for b, layers in pieces.items()
    }
    # the head's backward beyond the layers' ratio (0: priced at that ratio, bit for bit
    # as before the head had its own)
    head_extra = (head_backward - hardware.backward_over_forward) * head_time
    backward_piece = {
        BackwardStage(*b): (hardware.backward_over_forward * forward_piece[BackwardStage(*b)]
                            + (head_extra if layers.has_head else 0.0))
        for b, layers in pieces.items()
    }
    forward = tuple(
        sum(forward_piece[(stage, sub)] for sub in range(schedule.backward_split))
        for stage in range(schedule.forward_stages)
    )
    activation_bytes = 2.0 * tokens * model.hidden_size
    p2p = hardware.p2p_latency_s + activation_bytes / hardware.p2p_bytes_per_s
    # One FORWARD per forward stage and one BACKWARD per backward stage pay the per-pass
    # host overhead (a d-way split pays it d times per micro-batch; the recompute runs in
    # the backward's pass)
    overhead = hardware.pass_overhead_s
    return CostModel(
        forward=tuple(t + overhead for t in forward),
        backward={piece: t + overhead for piece, t in backward_piece.items()},
        recompute=dict(forward_piece),
        optimizer={piece: n / optimizer_rate for piece, n in params.items()},
        param_transfer={piece: 2.0 * n / hardware.pcie_bytes_per_s for piece, n in params.items()},
        grad_transfer={piece: grad_bytes * n / hardware.pcie_bytes_per_s
                       for piece, n in params.items()},
        p2p_activation=p2p,
        p2p_checkpoint=p2p,
        instruction=hardware.instruction_overhead_s,
        inter_node_transfer=({piece: 2.0 * n / hardware.inter_node_bytes_per_s
                              for piece, n in params.items()}
                             if hardware.inter_node_bytes_per_s > 0 else {}),
        disk=_disk_costs(schedule, params, hardware, optimizer_bytes),
        single_update_share=hardware.single_update_share,
    )


def _disk_costs(schedule: Schedule, params: dict, hardware: HardwareProfile,
                optimizer_bytes: int) -> DiskCosts | None:
    """What the drives cost a schedule that keeps its optimizer states on them (None for
    one that does not); a profile without drives cannot price it."""
    if not schedule.states_on_disk:
        return None
    if hardware.nvme_read_bytes_per_s <= 0 or hardware.nvme_write_bytes_per_s <= 0:
        raise ValueError(f"hardware {hardware.name!r} states no NVMe bandwidth "
                         "(nvme_read_bytes_per_s, nvme_write_bytes_per_s)")
    return DiskCosts(
        read={b: optimizer_bytes * n / hardware.nvme_read_bytes_per_s for b, n in params.items()},
        write={b: optimizer_bytes * n / hardware.nvme_write_bytes_per_s
               for b, n in params.items()},
        ranks_per_node=hardware.gpus_per_node)


def rollback_time(schedule: Schedule, costs: CostModel) -> float:
    """One rollback after a failed post-step check (SysX 3.3): Adam's step is reversed
    arithmetically, one more pass over every backward stage's parameters on its owner's CPU
    lane at the optimizer's rate, all ranks at once, nothing on the GPUs to hide it. The
    time of the slowest rank."""
    return max((sum(costs.optimizer[b] for b in schedule.owned_by(rank))
                for rank in range(schedule.ranks)), default=0.0)


def model_partition(
    model: ModelConfig | str, forward_stages: int, seq_length: int | None = None,
    min_layers: int = 1,
) -> list[int]:
    """Layers per forward stage balanced by forward flops, the head's output layer included,
    with at least `min_layers` per stage (a backward split d needs d layers per stage)."""
    model = get_preset(model) if isinstance(model, str) else model
    seq = seq_length or model.seq_length
    if model.num_layers < min_layers * forward_stages:
        raise ValueError(f"needs {min_layers} layers in each of {forward_stages} forward "
                         f"stages, the model has {model.num_layers}")
    # Every stage gets (min_layers - 1) layers up front and the rest is balanced: the fixed
    # part is the same for all stages, so the balance is kept.
    fixed = min_layers - 1
    rest = balanced_partition(
        model.num_layers - fixed * forward_stages,
        forward_stages,
        layer_cost=layer_forward_flops_per_token(model, seq),
        embedding_cost=0.0,  # a table lookup
        head_cost=head_forward_flops_per_token(model),
    )
    return [fixed + n for n in rest]


def backward_stage_params(model: ModelConfig, partition: Sequence[int],
                          backward_split: int) -> dict[BackwardStage, int]:
    """Parameters of every backward stage, from the closed-form count (nothing is built)."""
    counts = model.parameters()
    return {
        BackwardStage(*b): (layers.count * counts.per_layer
                            + (counts.embedding if layers.has_embedding else 0)
                            + (counts.head if layers.has_head else 0))
        for b, layers in sub_stage_layers(tuple(partition), backward_split).items()
    }


def calibrated_costs(
    schedule: Schedule,
    events: Sequence,
    params: dict[BackwardStage, int],
    itemsize: int,
    optimizer_s_per_param: float,
    copy_s_per_byte: float,
) -> CostModel:
    """A cost model from a measured iteration: mean compute time per forward stage and per
    backward stage (`events` from the executor's timeline, recompute included in the
    backward), optimizer and copy times from measured rates and each stage's size."""
    forward: dict[int, list[float]] = {}
    backward: dict[BackwardStage, list[float]] = {}
    for e in events:
        if e.resource != "compute":
            continue
        if e.kind == "forward":
            forward.setdefault(e.stage, []).append(e.end - e.start)
        else:
            backward.setdefault(BackwardStage(e.stage, e.sub), []).append(e.end - e.start)
    stages = schedule.backward_stages()
    missing = [i for i in range(schedule.forward_stages) if i not in forward]
    missing += [b for b in stages if b not in backward]
    if missing:
        raise ValueError(f"the measured events have no compute for {missing}")
    return CostModel(
        forward=tuple(statistics.mean(forward[i]) for i in range(schedule.forward_stages)),
        backward={b: statistics.mean(backward[b]) for b in stages},
        recompute={b: 0.0 for b in stages},  # measured backward times include it
        optimizer={b: params[b] * optimizer_s_per_param for b in stages},
        param_transfer={b: params[b] * itemsize * copy_s_per_byte for b in stages},
        grad_transfer={b: params[b] * itemsize * copy_s_per_byte for b in stages},
    )
