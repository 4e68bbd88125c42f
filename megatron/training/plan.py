"""`--plan` and `--auto-config`: will the run fit, how fast will it be, which shape is best.

Everything here reads the schedule package only (memory model, cost model, simulator): no
model, no data, no process group. A configuration is the schedule, forward stages, backward
split d, micro-batch size and node count; the flags give the model, the global batch, the
working dtype and the hardware profile.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass, replace

from megatron.models.presets import ModelPreset
from megatron.schedules.cost_model import derived_costs
from megatron.schedules.generators import SCHEDULE_NAMES
from megatron.schedules.hardware import HardwareProfile, get_hardware
from megatron.schedules.instructions import Schedule
from megatron.schedules.memory_model import (
    GPU_TERMS,
    NODE_TERMS,
    MemoryPlan,
    Shortfall,
    pinning_shortfall,
    plan_memory,
    shortfalls,
)
from megatron.schedules.simulator import SimResult, simulate
from megatron.schedules.validator import ValidationReport, validate
from megatron.training.arguments import ArgumentError
from megatron.training.pipeline_args import generate_schedule, optimizer_bytes_per_param

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3
GIB = 2**30
DEFAULT_HARDWARE = "paper-v100"


@dataclass(frozen=True)
class Configuration:
    schedule: str
    forward_stages: int | None  # None: the default for the schedule
    backward_split: int | None
    micro_batch_size: int
    nodes: int

    def flags(self) -> str:
        parts = [f"--pipeline-schedule {self.schedule}"]
        if self.forward_stages is not None:
            parts.append(f"--forward-stages {self.forward_stages}")
        if self.backward_split is not None:
            parts.append(f"--backward-split {self.backward_split}")
        parts += [f"--micro-batch-size {self.micro_batch_size}", f"--nodes {self.nodes}"]
        return " ".join(parts)


@dataclass
class Evaluation:
    config: Configuration
    schedule: Schedule
    memory: MemoryPlan
    missing: list[Shortfall]
    report: ValidationReport | None = None  # the schedule's validation, done once
    simulation: SimResult | None = None

    @property
    def fits(self) -> bool:
        return not self.missing

    def summary(self) -> dict:
        s = self.schedule
        out = {"schedule": s.name, "forward_stages": s.forward_stages,
               "backward_split": s.backward_split,
               "micro_batch_size": self.config.micro_batch_size,
               "micro_batches": s.micro_batches, "nodes": self.config.nodes,
               "fits": self.fits, "flags": self.config.flags()}
        if self.simulation is not None:
            out.update(predicted_iteration_s=self.simulation.iteration_time,
                       bubble_ratio=self.simulation.mean_bubble_ratio,
                       exposed_optimizer_s=self.simulation.exposed_optimizer_time)
        return out


def plan_hardware(args: argparse.Namespace) -> HardwareProfile:
    name = args.hardware or DEFAULT_HARDWARE
    try:
        return get_hardware(name)
    except KeyError as exc:
        raise ArgumentError("--hardware", name, str(exc).strip("'\"")) from None


def plan_model(args: argparse.Namespace) -> ModelPreset:
    return ModelPreset(args.model_preset or "custom", args.num_layers, args.hidden_size,
                       args.ffn_hidden_size, args.num_attention_heads, args.num_query_groups,
                       args.seq_length, args.vocab_size or 32000)


def working_bytes(args: argparse.Namespace) -> int:
    return 2 if (args.bf16 or args.fp16) else 4


def gpus_per_node(args: argparse.Namespace, hardware: HardwareProfile) -> int:
    return args.gpus_per_node or hardware.gpus_per_node


def base_configuration(args: argparse.Namespace) -> Configuration:
    return Configuration(args.pipeline_schedule if args.pipeline_schedule not in (None, "single")
                         else "decoupled", args.forward_stages, args.backward_split,
                         args.micro_batch_size, args.nodes or 1)


def evaluate(args: argparse.Namespace, config: Configuration, hardware: HardwareProfile,
             simulate_it: bool = True) -> Evaluation:
    """Memory (and, when asked, the simulated iteration) of `config` under `args`' model.
    Raises ArgumentError when the configuration cannot be built (shapes that do not divide)."""
    gpus = gpus_per_node(args, hardware)
    ranks = config.nodes * gpus
    run = copy.copy(args)
    run.pipeline_schedule, run.forward_stages = config.schedule, config.forward_stages
    run.backward_split, run.micro_batch_size = config.backward_split, config.micro_batch_size
    if config != base_configuration(args):
        run.stage_layers = None
    if run.global_batch_size % run.micro_batch_size:
        raise ArgumentError("--micro-batch-size", run.micro_batch_size,
                            f"must divide --global-batch-size ({run.global_batch_size})")
    model = plan_model(run)
    schedule = generate_schedule(run, ranks, model.vocab_size)
    itemsize = working_bytes(args)
    grad_host = 4 if hardware.device_kind == "cuda" else itemsize
    report = validate(schedule)
    memory = plan_memory(schedule, model, config.micro_batch_size, run.seq_length, itemsize,
                         grad_host, procs_per_node=gpus, hardware=hardware, report=report,
                         subgroup_stride=args.optimizer_gpu_stride,
                         subgroup_size=args.optimizer_subgroup_size,
                         resident_fraction=args.optimizer_gpu_resident_fraction,
                         optimizer_bytes=optimizer_bytes_per_param(args))
    evaluation = Evaluation(config, schedule, memory, shortfalls(memory, hardware), report)
    return simulated(args, evaluation, hardware) if simulate_it else evaluation


def simulated(args: argparse.Namespace, evaluation: Evaluation, hardware: HardwareProfile
              ) -> Evaluation:
    """`evaluation` with its simulated iteration (the schedule is reused)."""
    if evaluation.simulation is None:
        model = plan_model(args)
        costs = derived_costs(evaluation.schedule, model, hardware,
                              evaluation.config.micro_batch_size, args.seq_length)
        evaluation.simulation = simulate(evaluation.schedule, costs, evaluation.report)
    return evaluation


def _try(args, config, hardware, simulate_it=False) -> Evaluation | None:
    try:
        return evaluate(args, config, hardware, simulate_it)
    except ArgumentError:
        return None


def nearest_fit(args: argparse.Namespace, base: Evaluation, hardware: HardwareProfile,
                max_tries: int = 12) -> Evaluation | None:
    """The closest configuration that fits, one knob at a time, the cheapest first. Host
    memory, /dev/shm and memlock are per node: only more nodes help, from the count the
    shortfall implies. GPU memory: a smaller micro-batch, more forward stages (one more per
    rank, d = 1), another backward split, then one or two more nodes. At most `max_tries`
    configurations are built (a schedule of many ranks takes seconds)."""
    c = base.config
    per_node = [s for s in base.missing if s.resource != "gpu memory"]
    tries: list[Configuration] = []
    if per_node:
        worst = max(s.needed / s.available for s in per_node)
        first = max(c.nodes + 1, -(-int(c.nodes * worst * 1000) // 1000))
        tries += [replace(c, nodes=n) for n in range(first, first + 3)]
    else:
        mbs = c.micro_batch_size // 2
        while mbs >= 1:
            tries.append(replace(c, micro_batch_size=mbs))
            mbs //= 2
        ranks = c.nodes * gpus_per_node(args, hardware)
        stages = base.schedule.forward_stages
        tries += [replace(c, forward_stages=more, backward_split=1)
                  for more in range(stages + ranks, min(args.num_layers, stages + 3 * ranks) + 1,
                                    ranks)]
        if c.schedule == "decoupled":
            tries += [replace(c, backward_split=d) for d in (1, 3)
                      if d != base.schedule.backward_split]
        tries += [replace(c, nodes=n) for n in (c.nodes + 1, 2 * c.nodes) if n > c.nodes]
    for config in tries[:max_tries]:
        found = _try(args, config, hardware)
        if found is not None and found.fits:
            return simulated(args, found, hardware)
    return None


def search(args: argparse.Namespace, hardware: HardwareProfile) -> list[Evaluation]:
    """Every configuration at the given nodes and global batch that fits, fastest first:
    schedule x forward stages (1..4 per rank) x d (decoupled: 1..3) x micro-batch sizes
    dividing the global batch. (The optimizer's GPU stride does not exist in the runtime
    yet, so it is not searched.)"""
    nodes = args.nodes or 1
    ranks = nodes * gpus_per_node(args, hardware)
    sizes = [m for m in (1, 2, 4, 8, 16) if args.global_batch_size % m == 0
             and args.global_batch_size // m >= 1]
    found = []
    for name in SCHEDULE_NAMES:
        per_rank = (1,) if name in ("gpipe", "1f1b") else (1, 2, 3, 4)
        splits = (1, 2, 3) if name == "decoupled" else (1,)
        for k in per_rank:
            stages = k * ranks
            if stages > args.num_layers or (name == "interleaved-1f1b" and k == 1):
                continue
            for d in splits:
                if d * stages > args.num_layers:
                    continue
                for mbs in sizes:
                    config = Configuration(name, stages, d, mbs, nodes)
                    memory_only = _try(args, config, hardware)
                    if memory_only is not None and memory_only.fits:
                        found.append(simulated(args, memory_only, hardware))
    return sorted(found, key=lambda e: e.simulation.iteration_time)


# --- printing -----------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def _table(title: str, names: tuple[str, ...], rows: list[tuple[str, dict, int]],
           capacity_label: str) -> list[str]:
    head = f"{title:<10}" + "".join(f"{n.replace('_', ' ')[:16]:>17}" for n in names)
    lines = [head + f"{'total':>10}{capacity_label:>10}"]
    for label, terms, capacity in rows:
        total = sum(terms.values())
        lines.append(f"{label:<10}" + "".join(f"{_gib(terms[n]):>17}" for n in names)
                     + f"{_gib(total):>10}" + (f"{_gib(capacity):>10}" if capacity else
                                               f"{'-':>10}"))
    return lines


def describe(args: argparse.Namespace, evaluation: Evaluation, hardware: HardwareProfile) -> str:
    s, c, m = evaluation.schedule, evaluation.config, evaluation.memory
    gpus = gpus_per_node(args, hardware)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    lines = [f"plan: {args.model_preset or 'custom'} model on {c.nodes} node(s) x {gpus} GPUs "
             f"({hardware.name}), {s.name}, {s.forward_stages} forward stages, "
             f"d={s.backward_split}, {s.micro_batches} micro-batches of {c.micro_batch_size} x "
             f"{args.seq_length} tokens, {dtype}",
             "memory in GiB" + ("" if args.vocab_size else
                                f" (vocabulary {plan_model(args).vocab_size} assumed: give "
                                "--vocab-size)")]
    gpu_free = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes
    lines += _table("per GPU", GPU_TERMS, [(f"rank {r}", t, gpu_free)
                                           for r, t in enumerate(m.per_gpu)], "free")
    lines += _table("per node", NODE_TERMS, [(f"node {n}", t, hardware.host_memory_bytes)
                                             for n, t in enumerate(m.per_node)], "host")
    shm = max(t["shm_parameters"] for t in m.per_node)
    lines.append(f"/dev/shm: {shm / GIB:.2f} GiB of {hardware.shm_bytes / GIB:.2f} GiB "
                 "on the fullest node")
    over = pinning_shortfall(m, hardware)
    if over:
        lines.append(f"memlock: the pinned gradient buffers exceed ulimit -l by {over / GIB:.2f} "
                     "GiB; they fall back to pageable memory (slower copies): raise ulimit -l")
    if evaluation.fits:
        lines.append("fits: yes")
    else:
        worst = {}
        for short in evaluation.missing:  # the worst of each resource (they come sorted)
            worst.setdefault(short.resource, short)
        for short in worst.values():
            lines.append(f"fits: no: {short.resource} on {short.where} needs "
                         f"{short.needed / GIB:.2f} GiB, {short.available / GIB:.2f} GiB there "
                         f"({short.missing / GIB:.2f} GiB short)")
    if evaluation.simulation is not None:
        sim = evaluation.simulation
        lines.append(f"predicted iteration {sim.iteration_time:.3f} s, bubble ratio "
                     f"{sim.mean_bubble_ratio:.3f}, exposed optimizer {sim.exposed_optimizer_time:.3f} s")
    return "\n".join(lines)


def _candidates_text(found: list[Evaluation], top: int = 5) -> str:
    lines = [f"auto-config: {len(found)} configurations fit; the fastest {min(top, len(found))}:"]
    for i, e in enumerate(found[:top]):
        sim = e.simulation
        lines.append(f"  {i + 1}. {e.config.flags():<90} iteration {sim.iteration_time:.3f} s, "
                     f"bubble {sim.mean_bubble_ratio:.3f}, exposed optimizer "
                     f"{sim.exposed_optimizer_time:.3f} s")
    return "\n".join(lines)


def auto_configure(args: argparse.Namespace, log=print,
                   found: list[Evaluation] | None = None) -> argparse.Namespace:
    """`args` with the fastest fitting configuration (printed with the runners-up)."""
    hardware = plan_hardware(args)
    found = search(args, hardware) if found is None else found
    if not found:
        raise ArgumentError("--auto-config", "", "no configuration of this model fits "
                            f"{args.nodes or 1} node(s) of {hardware.name}; see --plan")
    log(_candidates_text(found))
    best = found[0].config
    return with_configuration(args, best)


def with_configuration(args: argparse.Namespace, config: Configuration) -> argparse.Namespace:
    chosen = copy.copy(args)
    chosen.pipeline_schedule, chosen.forward_stages = config.schedule, config.forward_stages
    chosen.backward_split, chosen.micro_batch_size = config.backward_split, config.micro_batch_size
    chosen.stage_layers = None
    return chosen


def configure_automatically(args: argparse.Namespace) -> argparse.Namespace:
    """--auto-config for a training run: the launcher's processes are the GPUs (rank 0
    prints the candidates)."""
    if args.hardware is None:
        raise ArgumentError("--hardware", "missing", "--auto-config trains on this machine: give "
                            "its profile (tools/profile_hardware.py --out hw.json)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    searched = copy.copy(args)
    searched.gpus_per_node = args.procs_per_node or local
    searched.nodes = max(1, world // searched.gpus_per_node)
    quiet = os.environ.get("RANK", "0") != "0"
    return auto_configure(searched, log=(lambda *_: None) if quiet else print)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (or, with --json, one JSON object); 0 when it fits, 3 when not."""
    hardware = plan_hardware(args)
    candidates: list[Evaluation] = []
    if args.auto_config:
        candidates = search(args, hardware)
        if candidates:
            args = auto_configure(args, log=lambda *_: None, found=candidates)
    evaluation = evaluate(args, base_configuration(args), hardware)
    nearest = None if evaluation.fits else nearest_fit(args, evaluation, hardware)
    if args.json:
        out = {"fits": evaluation.fits, "hardware": hardware.name,
               "configuration": evaluation.summary(),
               "per_gpu": [dict(t, rank=r) for r, t in enumerate(evaluation.memory.per_gpu)],
               "per_node": [dict(t, node=n) for n, t in enumerate(evaluation.memory.per_node)],
               "capacity": {"gpu_free": hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes,
                            "host": hardware.host_memory_bytes, "shm": hardware.shm_bytes}}
        if not evaluation.fits:
            worst = evaluation.missing[0]
            out.update(resource=worst.resource, where=worst.where, needed=worst.needed,
                       available=worst.available, short_by=worst.missing,
                       shortfalls=[vars(s) | {"short_by": s.missing} for s in evaluation.missing],
                       nearest_fit=nearest.summary() if nearest else None)
        if args.auto_config:
            out["candidates"] = [e.summary() for e in candidates[:5]]
        print(json.dumps(out, indent=1))
    else:
        if args.auto_config:
            print(_candidates_text(candidates))
        print(describe(args, evaluation, hardware))
        if not evaluation.fits:
            print("nearest configuration that fits: "
                  + (f"{nearest.config.flags()}" if nearest else "none one knob away"))
    return EXIT_FITS if evaluation.fits else EXIT_DOES_NOT_FIT
