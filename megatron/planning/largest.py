"""The largest LLaMA-2 shape a planned machine trains: what --plan adds for one GPU.

"Which model does my one GPU train?" is the first question of a user whose GPU is small
beside the host. The answer is the run's plan with the model swapped: each LLaMA-2 shape
(the released 7B, 13B and 70B of Touvron et al. 2023, and the SysX paper's sizes between
them), in size order, keeps the run's schedule, sequence, batch and precision, and
its memory is planned on the same hardware; where it does not fit, the planner's own
nearest fit (a cheaper optimizer state, the states on the node's NVMe drives, another
split or more forward stages, bf16 main gradients) is tried on the same nodes, never more of them. Only memory
is planned (nothing is simulated) until the answer, which is simulated once for its
predicted iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.model import ModelConfig
from megatron.config.presets import PRESETS
from megatron.config.run import RunConfig
from megatron.schedules.hardware import HardwareProfile

from .evaluate import (
    Configuration,
    Evaluation,
    base_configuration,
    evaluation_or_reason,
    optimizer_precision,
    ranks_of,
    simulated,
)
from .search import nearest_fit

GIB = 2**30
LLAMA2_VOCAB = 32000
# (layers, hidden, FFN, heads, KV heads) of the released LLaMA-2 models.
LLAMA2_RELEASED = {"7b": (32, 4096, 11008, 32, 32), "13b": (40, 5120, 13824, 40, 40),
                   "70b": (80, 8192, 28672, 64, 8)}


def llama2_shapes() -> list[ModelConfig]:
    """The released LLaMA-2 shapes and the SysX paper's (the presets 10b ... 110b), by
    parameter count."""
    shapes = [ModelConfig(name=name, num_layers=layers, hidden_size=hidden,
                          ffn_hidden_size=ffn, num_attention_heads=heads,
                          num_query_groups=kv, seq_length=4096, vocab_size=LLAMA2_VOCAB)
              for name, (layers, hidden, ffn, heads, kv) in LLAMA2_RELEASED.items()]
    shapes += [p for p in PRESETS.values() if p.paper_size_billions is not None]
    return sorted(shapes, key=lambda m: m.parameters().total)


@dataclass(frozen=True)
class LargestModel:
    """The answer: the largest shape that fits (None: not even the smallest), how, and the
    next larger one's shortfall."""

    fits: ModelConfig | None
    evaluation: Evaluation | None  # the fitting shape's configuration, simulated
    note: str  # what the fitting configuration changes of the run ('' when nothing)
    next_shape: ModelConfig | None  # the next larger shape (None: the largest fits)
    next_short: str  # why the next one does not fit: resource, where, GiB short

    def summary(self) -> dict:
        out: dict = {"model": None, "parameters": None}
        if self.fits is not None:
            sim = self.evaluation.simulation
            out.update(model=self.fits.name, parameters=self.fits.parameters().total,
                       shape=shape_flags(self.fits),
                       flags=self.evaluation.config.flags(), changes=self.note or None,
                       predicted_iteration_s=sim.iteration_time if sim else None,
                       mfu=self.evaluation.mfu)
        out["next"] = (None if self.next_shape is None else
                       {"model": self.next_shape.name,
                        "parameters": self.next_shape.parameters().total,
                        "shape": shape_flags(self.next_shape),
                        "does_not_fit": self.next_short})
        return out


def shape_flags(shape: ModelConfig) -> str:
    """The flags that give a run `shape` (sequence, batch and tokenizer are the run's)."""
    flags = (f"--num-layers {shape.num_layers} --hidden-size {shape.hidden_size} "
             f"--ffn-hidden-size {shape.ffn_hidden_size} --num-attention-heads "
             f"{shape.num_attention_heads}")
    if shape.num_query_groups != shape.num_attention_heads:
        flags += f" --group-query-attention --num-query-groups {shape.num_query_groups}"
    return flags


def with_model(run: RunConfig, shape: ModelConfig) -> RunConfig:
    """`run` training `shape` (its sequence and the run's other fields kept): a plan has no
    tokenizer, so the vocabulary is the shape's; a schedule file and a hand partition are
    the run's model's, not this one's."""
    return run.evolve(model={f: getattr(shape, f) for f in (
        "name", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "vocab_size")} | {"kv_channels": None},
        parallel={"schedule_file": None, "stage_layers": None})


def stage_ladder(run: RunConfig, ranks: int) -> list[int | None]:
    """The forward stages tried for a shape: the schedule's default, then twice as many per
    rank each time, down to one layer per stage (a GPU holds two stages' parameters)."""
    ladder: list[int | None] = [None]
    stages = 2 * ranks
    while stages <= run.model.num_layers:
        ladder.append(stages)
        stages *= 2
    return ladder


def fitting(run: RunConfig, hardware: HardwareProfile) -> Evaluation | str:
    """The run's schedule on the run's nodes with its stages by default, else more forward
    stages while GPU memory is short, else the planner's nearest fit on the same GPUs (a
    cheaper optimizer state, the NVMe tier, a smaller micro-batch, bf16 main gradients);
    else why not, in words."""
    c = base_configuration(run)
    ranks = ranks_of(run, c, hardware)
    why = "no configuration could be built"
    ladder = stage_ladder(run, ranks)
    for stages in ladder:
        config = Configuration(c.schedule, stages, None if stages is None else 1,
                               c.micro_batch_size, c.nodes)
        found = evaluation_or_reason(run, config, hardware)
        if not isinstance(found, Evaluation):
            continue
        if found.fits:
            return found
        short = found.missing[0]
        why = (f"{short.resource} on {short.where} short by {short.missing / GIB:.1f} GiB "
               f"at {found.schedule.forward_stages} forward stages")
        gpu_short = any(s.resource == "gpu memory" for s in found.missing)
        if gpu_short and stages != ladder[-1]:
            continue  # more stages first: they shrink what a GPU holds
        nearest = nearest_fit(run, found, hardware)
        if nearest is not None and ranks_of(run, nearest.config, hardware) == ranks:
            return nearest
        break
    return why


def changes(run: RunConfig, config: Configuration) -> str:
    """What `config` changes of the run's optimizer state and main gradients, in a few
    words ('' when nothing)."""
    moments, master = optimizer_precision(run, config)
    p = run.precision
    parts = [f"{what} in {dtype}" for what, dtype, own in (
        ("m and v", moments, p.optimizer_state_dtype), ("master", master, p.master_dtype))
        if dtype != own]
    if config.placement(run).states.on_nvme and not run.cpu_optimizer.placement.states.on_nvme:
        parts.append("the optimizer states on NVMe")
    if config.grad_reduce_in_bf16 and not p.grad_reduce_in_bf16:
        parts.append("main gradients in bf16")
    return ", ".join(parts)


def largest_model(run: RunConfig, hardware: HardwareProfile) -> LargestModel:
    """Up the LLaMA-2 shapes until one does not fit on the run's nodes and GPUs."""
    best: tuple[ModelConfig, Evaluation, str] | None = None
    for shape in llama2_shapes():
        sized = with_model(run, shape)
        found = fitting(sized, hardware)
        if isinstance(found, str):
            return _answer(run, best, hardware, shape, found)
        best = shape, found, changes(sized, found.config)
    return _answer(run, best, hardware, None, "")


def _answer(run: RunConfig, best: tuple[ModelConfig, Evaluation, str] | None,
            hardware: HardwareProfile, next_shape: ModelConfig | None,
            next_short: str) -> LargestModel:
    if best is None:
        return LargestModel(None, None, "", next_shape, next_short)
    shape, evaluation, note = best
    return LargestModel(shape, simulated(with_model(run, shape), evaluation, hardware), note,
                        next_shape, next_short)


def largest_text(run: RunConfig, hardware: HardwareProfile, found: LargestModel) -> str:
    """One line for the plan."""
    c = found.evaluation.config if found.evaluation else base_configuration(run)
    where = (f"{c.nodes} node(s) x {ranks_of(run, c, hardware) // c.nodes} GPU(s) of "
             f"{hardware.name}, {hardware.host_memory_bytes / GIB:.0f} GiB host memory per node, "
             f"sequence {run.model.seq_length}, micro-batch {run.training.micro_batch_size}")
    beyond = ""
    if found.next_shape is not None:
        beyond = (f"{found.next_shape.name} ({found.next_shape.parameters().total / 1e9:.2f} B) "
                  f"does not fit: {found.next_short} (nor with a cheaper optimizer state"
                  + (", on NVMe" if hardware.nvme_capacity_bytes else
                     "; the profile has no NVMe drive for the optimizer states")
                  + ")")
    if found.fits is None:
        return f"largest LLaMA-2 shape that trains here ({where}): none; {beyond}"
    sim = found.evaluation.simulation
    text = (f"largest LLaMA-2 shape that trains here ({where}): {found.fits.name} "
            f"({found.fits.parameters().total / 1e9:.2f} B parameters) with "
            f"{found.evaluation.config.flags()}")
    if found.note:
        text += f" ({found.note})"
    if sim is not None:
        text += f", predicted iteration {sim.iteration_time:.3f} s, MFU {found.evaluation.mfu:.3f}"
    return text + (f"; {beyond}" if beyond else "")
