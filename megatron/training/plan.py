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
import math
import os
from dataclasses import dataclass, replace

from megatron.common.workers import cores_per_rank, worker_pool
from megatron.models.presets import ModelPreset
from megatron.schedules.cost_model import (
    DeviceUpdateCosts,
    backward_stage_params,
    derived_costs,
    iteration_lower_bound,
)
from megatron.schedules.generators import SCHEDULE_NAMES, optimizer_mode
from megatron.schedules.hardware import HardwareProfile, get_hardware, update_rates
from megatron.schedules.instructions import Schedule
from megatron.schedules.lowering import SYNCHRONOUS_OPTIMIZER
from megatron.schedules.memory_model import (
    GPU_TERMS,
    NODE_TERMS,
    MemoryPlan,
    Shortfall,
    pinning_shortfall,
    plan_memory,
    shape_report,
    shortfalls,
)
from megatron.schedules.optimizer_placement import place_device_subgroups
from megatron.schedules.optimizer_stride import gpu_update_stride
from megatron.schedules.simulator import SimResult, simulate
from megatron.schedules.validator import ValidationReport, validate
from megatron.training.arguments import ArgumentError
from megatron.training.pipeline_args import generate_schedule, optimizer_bytes_per_param

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3
SEARCH_TOP = 5  # candidates --auto-config prints (and proves the fastest of)
GIB = 2**30
DEFAULT_HARDWARE = "paper-v100"


@dataclass(frozen=True)
class Configuration:
    schedule: str
    forward_stages: int | None  # None: the default for the schedule
    backward_split: int | None
    micro_batch_size: int
    nodes: int
    optimizer_gpu_stride: int | None = 0  # every k-th subgroup on the GPU (None: Eq. 1's k)

    def flags(self) -> str:
        parts = [f"--pipeline-schedule {self.schedule}"]
        if self.forward_stages is not None:
            parts.append(f"--forward-stages {self.forward_stages}")
        if self.backward_split is not None:
            parts.append(f"--backward-split {self.backward_split}")
        parts += [f"--micro-batch-size {self.micro_batch_size}", f"--nodes {self.nodes}"]
        if self.optimizer_gpu_stride != 0:
            stride = self.optimizer_gpu_stride
            parts.append(f"--optimizer-gpu-stride {'auto' if stride is None else stride}")
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
               "optimizer_gpu_stride": self.config.optimizer_gpu_stride,
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
                         args.micro_batch_size, args.nodes or 1, args.optimizer_gpu_stride)


def _configured(args: argparse.Namespace, config: Configuration) -> argparse.Namespace:
    """`args` with `config`'s pipeline shape (a hand partition holds for its own shape only)."""
    run = with_configuration(args, config)
    if replace(config, optimizer_gpu_stride=0) == replace(base_configuration(args),
                                                         optimizer_gpu_stride=0):
        run.stage_layers = args.stage_layers
    if run.global_batch_size % run.micro_batch_size:
        raise ArgumentError("--micro-batch-size", run.micro_batch_size,
                            f"must divide --global-batch-size ({run.global_batch_size})")
    return run


def evaluate(args: argparse.Namespace, config: Configuration, hardware: HardwareProfile,
             simulate_it: bool = True) -> Evaluation:
    """Memory (and, when asked, the simulated iteration) of `config` under `args`' model.
    Raises ArgumentError when the configuration cannot be built (shapes that do not divide)."""
    base = replace(config, optimizer_gpu_stride=0)
    run = _configured(args, base)
    schedule = generate_schedule(run, config.nodes * gpus_per_node(args, hardware),
                                 plan_model(run).vocab_size)
    evaluation = _planned(args, base, schedule, validate(schedule), hardware)
    if config.optimizer_gpu_stride != 0:
        evaluation = _with_stride(args, evaluation, config.optimizer_gpu_stride, hardware)
    return simulated(args, evaluation, hardware) if simulate_it else evaluation


def _with_stride(args: argparse.Namespace, plain: Evaluation, stride: int | None,
                 hardware: HardwareProfile) -> Evaluation:
    """`plain` (all updates on the CPU) with device subgroups every `stride`-th where an
    update would be exposed; only optimizer starts change, so its validation holds."""
    placed = place_device_subgroups(plain.schedule, report=plain.report)
    return _planned(args, replace(plain.config, optimizer_gpu_stride=stride), placed,
                    plain.report, hardware)


def _planned(args: argparse.Namespace, config: Configuration, schedule: Schedule,
             report: ValidationReport, hardware: HardwareProfile) -> Evaluation:
    itemsize = working_bytes(args)
    memory = plan_memory(schedule, plan_model(args), config.micro_batch_size, args.seq_length,
                         itemsize, 4 if hardware.device_kind == "cuda" else itemsize,
                         procs_per_node=gpus_per_node(args, hardware), hardware=hardware,
                         report=report, subgroup_stride=config.optimizer_gpu_stride,
                         subgroup_size=args.optimizer_subgroup_size,
                         resident_fraction=args.optimizer_gpu_resident_fraction,
                         optimizer_bytes=optimizer_bytes_per_param(args))
    return Evaluation(config, schedule, memory, shortfalls(memory, hardware), report)


def simulated(args: argparse.Namespace, evaluation: Evaluation, hardware: HardwareProfile
              ) -> Evaluation:
    """`evaluation` with its simulated iteration (the schedule is reused); device subgroups
    are priced from the profile's rates when it has them (else like a CPU update)."""
    if evaluation.simulation is None:
        model, config = plan_model(args), evaluation.config
        schedule = evaluation.schedule
        costs = derived_costs(schedule, model, hardware, config.micro_batch_size,
                              args.seq_length)
        rates = update_rates(hardware)
        if config.optimizer_gpu_stride != 0 and rates is not None:
            stride = config.optimizer_gpu_stride or gpu_update_stride(rates).k
            params = backward_stage_params(model, schedule.partition, schedule.backward_split)
            costs = replace(costs, device_update=DeviceUpdateCosts(stride, params, rates))
        evaluation.simulation = simulate(schedule, costs, evaluation.report)
    return evaluation


def _try(args, config, hardware, simulate_it=False) -> Evaluation | None:
    try:
        return evaluate(args, config, hardware, simulate_it)
    except ArgumentError:
        return None


def lower_bound(args: argparse.Namespace, config: Configuration, hardware: HardwareProfile
                ) -> float | None:
    """A time `config`'s simulated iteration cannot beat, from its shape alone (no programs
    built); None when it cannot be built or cannot fit even at the memory it needs at least."""
    try:
        run = _configured(args, config)
        model = plan_model(run)
        shape = generate_schedule(run, config.nodes * gpus_per_node(args, hardware),
                                  model.vocab_size, lower=False)
    except ArgumentError:
        return None
    if _planned(args, replace(config, optimizer_gpu_stride=0), shape, shape_report(shape),
                hardware).missing:
        return None
    costs = derived_costs(shape, model, hardware, config.micro_batch_size, args.seq_length)
    stride = max(searched_strides(args, hardware))  # the bound holds for every stride searched
    return iteration_lower_bound(
        shape, costs, cpu_share=1.0 - 1.0 / stride if stride else 1.0,
        steps_after_all_compute=optimizer_mode(config.schedule) == SYNCHRONOUS_OPTIMIZER)


def nearest_fit(args: argparse.Namespace, base: Evaluation, hardware: HardwareProfile,
                max_tries: int = 12) -> Evaluation | None:
    """The closest configuration that fits, one knob at a time, what the run computes kept
    first. Host memory, /dev/shm and memlock are per node: only more nodes help, from the
    count the shortfall implies. GPU memory: another backward split, more forward stages
    (one more per rank, d = 1), a smaller micro-batch, then one or two more nodes. At most
    `max_tries` configurations are built (a schedule of many ranks takes seconds); those
    whose lower-bound memory cannot fit are skipped unbuilt."""
    c = base.config
    per_node = [s for s in base.missing if s.resource != "gpu memory"]
    tries: list[Configuration] = []
    if per_node:
        worst = max(s.needed / s.available for s in per_node)
        first = max(c.nodes + 1, -(-int(c.nodes * worst * 1000) // 1000))
        tries += [replace(c, nodes=n) for n in range(first, first + 3)]
    else:
        if c.schedule == "decoupled":
            tries += [replace(c, backward_split=d) for d in (1, 3)
                      if d != base.schedule.backward_split]
        ranks = c.nodes * gpus_per_node(args, hardware)
        stages = base.schedule.forward_stages
        tries += [replace(c, forward_stages=more, backward_split=1)
                  for more in range(stages + ranks, min(args.num_layers, stages + 3 * ranks) + 1,
                                    ranks)]
        mbs = c.micro_batch_size // 2
        while mbs >= 1:
            tries.append(replace(c, micro_batch_size=mbs))
            mbs //= 2
        tries += [replace(c, nodes=n) for n in (c.nodes + 1, 2 * c.nodes) if n > c.nodes]
    built = 0
    for config in tries:
        if built == max_tries:
            break
        if lower_bound(args, config, hardware) is None:
            continue
        built += 1
        found = _try(args, config, hardware)
        if found is not None and found.fits:
            return simulated(args, found, hardware)
    return None


@dataclass
class SearchResult:
    """What --auto-config compared: the fastest fitting candidates first (at least the
    `SEARCH_TOP` fastest of all), and how many configurations each step set aside."""

    ranked: list[Evaluation]
    configurations: int  # every combination of the searched knobs
    cannot_fit: int  # set aside unbuilt: they cannot be built or their least memory does not fit
    cannot_win: int  # set aside unbuilt: their lower-bound time is above the fifth fastest
    built: int  # built, validated and simulated (those that fit are ranked)


def searched_strides(args: argparse.Namespace, hardware: HardwareProfile) -> tuple[int, ...]:
    """The optimizer GPU strides to compare: all on the CPU, and Eq. 1's k for the profile
    (when it has the device rates and the static split is not asked for)."""
    rates = update_rates(hardware)
    if rates is None or args.optimizer_gpu_resident_fraction > 0:
        return (0,)
    k = gpu_update_stride(rates).k
    return (0, k) if k else (0,)


def searched_configurations(args: argparse.Namespace, hardware: HardwareProfile) -> list[Configuration]:
    """schedule x forward stages (1..4 per rank) x d (decoupled: 1..3) x micro-batch sizes
    dividing the global batch, all on the CPU optimizer (the stride is tried per shape)."""
    nodes = args.nodes or 1
    ranks = nodes * gpus_per_node(args, hardware)
    sizes = [m for m in (1, 2, 4, 8, 16) if args.global_batch_size % m == 0]
    found = []
    for name in SCHEDULE_NAMES:
        per_rank = (1,) if name in ("gpipe", "1f1b") else (1, 2, 3, 4)
        splits = (1, 2, 3) if name == "decoupled" else (1,)
        for k in per_rank:
            stages = k * ranks
            if stages > args.num_layers or (name == "interleaved-1f1b" and k == 1):
                continue
            found += [Configuration(name, stages, d, mbs, nodes, 0)
                      for d in splits if d * stages <= args.num_layers for mbs in sizes]
    return found


def search(args: argparse.Namespace, hardware: HardwareProfile, top: int = SEARCH_TOP,
           workers: int | None = None) -> SearchResult:
    """The fastest configurations at the given nodes and global batch that fit, exactly as
    if every one were simulated: each shape's lower bounds (memory and time, from its shape
    alone) set aside what cannot fit, then shapes are built in order of their time bound,
    `workers` at a time (default: the cores this rank may use), until the next bound is
    above the `top`-th fastest found. A built shape is simulated with each optimizer GPU
    stride of `searched_strides`. The ranked evaluations keep their schedule's shape, not its
    programs, and their simulation's figures, not its events."""
    shapes = searched_configurations(args, hardware)
    strides = searched_strides(args, hardware)
    bounded = []
    for config in shapes:
        bound = lower_bound(args, config, hardware)
        if bound is not None:
            bounded.append((bound, len(bounded), config))
    bounded.sort()
    ranked: list[Evaluation] = []
    built = 0
    workers = workers or cores_per_rank()
    with worker_pool(min(workers, max(1, len(bounded)))) as run_all:
        while built < len(bounded):
            cutoff = (ranked[top - 1].simulation.iteration_time if len(ranked) >= top
                      else math.inf)
            wave = [config for bound, _, config in bounded[built:built + workers]
                    if bound <= cutoff]  # a tie with the fifth may still rank before it
            if not wave:
                break  # sorted by bound: nothing later can beat the cutoff either
            built += len(wave)
            for evaluations in run_all(evaluate_shape,
                                       [(args, config, strides, hardware) for config in wave]):
                ranked += evaluations
            ranked.sort(key=rank_key)
    return SearchResult(ranked, len(shapes) * len(strides),
                        (len(shapes) - len(bounded)) * len(strides),
                        (len(bounded) - built) * len(strides), built * len(strides))


def rank_key(evaluation: Evaluation) -> tuple[float, str]:
    """Fastest first; equal predictions in the order of their flags, so that the ranking
    does not depend on the order the configurations were built in."""
    return evaluation.simulation.iteration_time, evaluation.config.flags()


def evaluate_shape(job: tuple) -> list[Evaluation]:
    """One shape's fitting evaluations, simulated, light enough to come back from a worker.
    A stride is kept only where it is predicted faster than every update on the CPU (where
    no update is exposed it changes nothing but the device memory it takes)."""
    args, config, strides, hardware = job
    out: list[Evaluation] = []
    for evaluation in _strided(args, config, strides, hardware):
        if not evaluation.fits:
            continue
        evaluation = simulated(args, evaluation, hardware)
        if out and evaluation.simulation.iteration_time >= out[0].simulation.iteration_time:
            continue
        evaluation.schedule = replace(evaluation.schedule, programs=())
        evaluation.simulation = replace(evaluation.simulation, events=())
        out.append(evaluation)
    return out


def _strided(args: argparse.Namespace, config: Configuration, strides: tuple[int, ...],
             hardware: HardwareProfile) -> list[Evaluation]:
    """`config` evaluated (memory only) with each stride, its programs built and checked once."""
    try:
        plain = evaluate(args, config, hardware, simulate_it=False)
    except ArgumentError:
        return []
    out = [plain]
    for stride in strides:
        if stride:
            strided = _with_stride(args, plain, stride, hardware)
            if strided.schedule.programs != plain.schedule.programs:  # else the same run
                out.append(strided)
    return out


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


def _candidates_text(found: SearchResult, top: int = SEARCH_TOP) -> str:
    ranked = found.ranked
    lines = [f"auto-config: {found.configurations} configurations: {found.cannot_fit} cannot "
             f"fit, {found.cannot_win} cannot beat the fastest {top} (lower bounds), "
             f"{found.built} simulated; the fastest {min(top, len(ranked))}:"]
    for i, e in enumerate(ranked[:top]):
        sim = e.simulation
        lines.append(f"  {i + 1}. {e.config.flags():<90} iteration {sim.iteration_time:.3f} s, "
                     f"bubble {sim.mean_bubble_ratio:.3f}, exposed optimizer "
                     f"{sim.exposed_optimizer_time:.3f} s")
    return "\n".join(lines)


def auto_configure(args: argparse.Namespace, log=print,
                   found: SearchResult | None = None) -> argparse.Namespace:
    """`args` with the fastest fitting configuration (printed with the runners-up)."""
    hardware = plan_hardware(args)
    found = search(args, hardware) if found is None else found
    if not found.ranked:
        raise ArgumentError("--auto-config", "", "no configuration of this model fits "
                            f"{args.nodes or 1} node(s) of {hardware.name}; see --plan")
    log(_candidates_text(found))
    return with_configuration(args, found.ranked[0].config)


def with_configuration(args: argparse.Namespace, config: Configuration) -> argparse.Namespace:
    chosen = copy.copy(args)
    chosen.pipeline_schedule, chosen.forward_stages = config.schedule, config.forward_stages
    chosen.backward_split, chosen.micro_batch_size = config.backward_split, config.micro_batch_size
    chosen.optimizer_gpu_stride = config.optimizer_gpu_stride
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
    candidates = SearchResult([], 0, 0, 0, 0)
    if args.auto_config:
        candidates = search(args, hardware)
        if candidates.ranked:
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
            out["candidates"] = [e.summary() for e in candidates.ranked[:SEARCH_TOP]]
            out["search"] = {"configurations": candidates.configurations,
                             "cannot_fit": candidates.cannot_fit,
                             "cannot_win": candidates.cannot_win, "built": candidates.built}
        print(json.dumps(out, indent=1))
    else:
        if args.auto_config:
            print(_candidates_text(candidates))
        print(describe(args, evaluation, hardware))
        if not evaluation.fits:
            print("nearest configuration that fits: "
                  + (f"{nearest.config.flags()}" if nearest else "none one knob away"))
    return EXIT_FITS if evaluation.fits else EXIT_DOES_NOT_FIT
