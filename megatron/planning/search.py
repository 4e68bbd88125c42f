"""`--auto-config`: the fastest configuration that fits, proven without building them all.

Every combination of the searched knobs (schedule, forward stages, backward split,
micro-batch size, and the optimizer's GPU stride) is bounded from its shape alone, before
any program exists: the memory it needs at least, and a time its iteration cannot beat.
What cannot fit or cannot win is set aside unbuilt; the rest is built, validated and
simulated in forked workers, in order of its time bound. `nearest_fit` is the same
machinery for --plan: the closest configuration that fits, one knob at a time.

Host memory is what a node is rented for, and most of it is the optimizer state (12 bytes
per parameter in fp32). Both look at its cheaper precisions before more nodes: Adam's m
and v in bf16 (8 bytes), then the master too (6 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron.common.workers import cores_per_rank, worker_pool
from megatron.config.errors import ConfigError
from megatron.config.placement import ON_HOST, DeviceShare, Interleaved, StateStorage
from megatron.config.run import RunConfig
from megatron.schedules.cost_model import derived_costs, iteration_lower_bound
from megatron.schedules.generators import DEFAULT_SCHEDULE, SCHEDULE_KINDS, schedule_kind
from megatron.schedules.hardware import HardwareProfile, update_rates
from megatron.schedules.memory_model import shape_report
from megatron.schedules.optimizer_stride import auto_split, device_share

from .evaluate import (
    Configuration,
    Evaluation,
    configured,
    evaluation_or_reason,
    gpus_per_node,
    gradient_precision,
    optimizer_bytes,
    optimizer_precision,
    plain_updates,
    planned,
    ranks_of,
    simulated,
    with_subgroups,
)
from .shape import Unbuildable, build_run_schedule

SEARCH_TOP = 5  # candidates --auto-config prints (and proves the fastest of)


def batch_divides(run: RunConfig, config: Configuration) -> bool:
    """`config`'s micro-batches fill the global batch on every data-parallel replica."""
    return run.training.global_batch_size % (config.micro_batch_size
                                             * run.data_parallel_size) == 0


def lower_bound(run: RunConfig, config: Configuration, hardware: HardwareProfile
                ) -> float | None:
    """A time `config`'s simulated iteration cannot beat, from its shape alone (no programs
    built); None when it cannot be built or cannot fit even at the memory it needs at least."""
    if not batch_divides(run, config):
        return None
    shape = build_run_schedule(configured(run, config), ranks_of(run, config, hardware),
                               run.model.planned_vocab_size, lower=False)
    if isinstance(shape, Unbuildable):
        return None
    if planned(run, replace(config, updates=plain_updates(config.updates)), shape,
               shape_report(shape), hardware).missing:
        return None
    costs = derived_costs(shape, run.model, hardware, config.micro_batch_size,
                          run.model.seq_length,
                          grad_bytes=gradient_precision(run, config).precision.host_gradient_bytes)
    # the bound holds for every split searched: the largest device share
    share = max(device_share(updates.split) for updates in searched_updates(run, hardware))
    return iteration_lower_bound(
        shape, costs, cpu_share=1.0 - share,
        steps_after_all_compute=not schedule_kind(config.schedule).optimizer_overlaps)


PER_NODE = ("host memory", "/dev/shm")  # what only more nodes or less state per node mend
Precision = tuple[str | None, str | None]  # (m and v, master) as Configuration takes them


def cheaper_precisions(run: RunConfig) -> list[Precision]:
    """The optimizer-state precisions below the run's, in the order they are tried: m and v
    in bf16 (12 -> 8 bytes per parameter), then the master too (6)."""
    p = run.precision
    steps: list[Precision] = []
    if p.optimizer_state_dtype != "bf16":
        steps.append(("bf16", None))
    if p.master_dtype != "bf16":
        steps.append(("bf16", "bf16"))
    return steps


def precision_note(run: RunConfig, config: Configuration) -> str:
    """What `config` changes of the run's precisions and of where its optimizer state
    lives, in words ('' when nothing)."""
    notes = []
    on_disk = (config.states is not None and config.states.on_nvme
               and not run.cpu_optimizer.placement.states.on_nvme)
    if config.optimizer_state_dtype is not None or config.master_dtype is not None or on_disk:
        moments, master = optimizer_precision(run, config)
        where = ("on NVMe (a window of stages in host memory)"
                 if config.placement(run).states.on_nvme else "in host memory")
        size, own = optimizer_bytes(run, config), run.precision.optimizer_bytes_per_param
        notes.append(f"the optimizer state {where} with m and v in {moments} and the master "
                     f"in {master}: {size} bytes per parameter"
                     + (f" instead of {own}" if size != own else ""))
    if config.grad_reduce_in_bf16 and not run.precision.grad_reduce_in_bf16:
        notes.append("the main gradients in bf16 instead of fp32: the micro-batches' "
                     "gradients summed and offloaded in bf16, half the gradient buffers")
    return "; ".join(notes)


def with_precision(config: Configuration, precision: Precision) -> Configuration:
    return replace(config, optimizer_state_dtype=precision[0], master_dtype=precision[1])


def repriced(run: RunConfig, evaluation: Evaluation, precision: Precision,
             hardware: HardwareProfile) -> Evaluation:
    """`evaluation` with another optimizer-state precision: the same schedule, its memory
    planned again (cheap: nothing is built)."""
    return planned(run, with_precision(evaluation.config, precision), evaluation.schedule,
                   evaluation.report, hardware)


def states_on_nvme(run: RunConfig, evaluation: Evaluation, hardware: HardwareProfile
                   ) -> Evaluation | None:
    """`evaluation` with the optimizer states on the node's NVMe drives (a window of stages
    in host memory), when the profile has drives and the run keeps them in memory."""
    if (evaluation.config.placement(run).states.on_nvme
            or hardware.nvme_read_bytes_per_s <= 0 or hardware.nvme_write_bytes_per_s <= 0):
        return None
    found = evaluation_or_reason(
        run, replace(evaluation.config, states=StateStorage(on_nvme=True)), hardware)
    return found if isinstance(found, Evaluation) else None


def per_node_fits(evaluation: Evaluation) -> bool:
    return not any(s.resource in PER_NODE for s in evaluation.missing)


def implied_nodes(evaluation: Evaluation) -> int:
    """The fewest nodes the per-node shortfalls of `evaluation` allow, were they shared out
    evenly (more may be needed: the per-process baseline and replicas do not shrink)."""
    nodes = evaluation.config.nodes
    worst = max([s.needed / s.available for s in evaluation.missing if s.resource in PER_NODE],
                default=1.0)
    return max(nodes + 1, -(-int(nodes * worst * 1000) // 1000))


def nearest_fit(run: RunConfig, base: Evaluation, hardware: HardwareProfile,
                max_tries: int = 12) -> Evaluation | None:
    """The closest configuration that fits, one knob at a time, what the run computes kept
    first. Host memory and /dev/shm are per node: at the run's nodes, the optimizer state's
    cheaper precisions (`cheaper_precisions`) are tried first (the same schedule, planned
    again), then the states on the node's NVMe drives when the profile has them (the
    schedule with their reads and writes) if that fits; when none fits the node, more
    nodes, from the count the shortfall at the cheapest precision implies, each with the
    run's precision first, then the cheaper ones. GPU memory: another backward split, more
    forward stages (one more per rank, d = 1), a smaller micro-batch, a --bf16 run's main
    gradients in bf16 (--grad-reduce-in-bf16: half the gradient buffers, the sums rounded
    as Megatron-LM's flag rounds them), then one or two more nodes. At most `max_tries` configurations are built (a
    schedule of many ranks takes seconds); those whose lower-bound memory cannot fit are
    skipped unbuilt."""
    precisions: list[Precision] = [(base.config.optimizer_state_dtype,
                                    base.config.master_dtype), *cheaper_precisions(run)]
    if not per_node_fits(base):
        for precision in precisions[1:]:
            cheaper = repriced(run, base, precision, hardware)
            if per_node_fits(cheaper):
                if cheaper.fits:
                    return simulated(run, cheaper, hardware)
                base = cheaper  # the GPU knobs from this precision
                break
    if not per_node_fits(base):
        on_disk = states_on_nvme(run, base, hardware)
        for precision in precisions if on_disk is not None else ():
            found = repriced(run, on_disk, precision, hardware)  # the same schedule's memory
            if found.fits:  # (GPU memory short too: more nodes, below, help both)
                return simulated(run, found, hardware)
    c = base.config
    tries: list[Configuration] = []
    if not per_node_fits(base):
        # from the nodes the shortfall implies at the cheapest state to 2 beyond the run's
        first, last = (implied_nodes(repriced(run, base, p, hardware)) for p in
                       (precisions[-1], precisions[0]))
        tries += [replace(c, nodes=n) for n in range(first, last + 3)]
    else:
        if schedule_kind(c.schedule).splits_backward:
            tries += [replace(c, backward_split=d) for d in (1, 3)
                      if d != base.schedule.backward_split]
        ranks = ranks_of(run, c, hardware)
        stages, layers = base.schedule.forward_stages, run.model.num_layers
        tries += [replace(c, forward_stages=more, backward_split=1)
                  for more in range(stages + ranks, min(layers, stages + 3 * ranks) + 1, ranks)]
        mbs = c.micro_batch_size // 2
        while mbs >= 1:
            tries.append(replace(c, micro_batch_size=mbs))
            mbs //= 2
        if run.precision.dtype == "bf16" and run.precision.host_gradient_dtype == "fp32":
            tries.append(replace(c, grad_reduce_in_bf16=True))  # half the gradient buffers
        tries += [replace(c, nodes=n) for n in (c.nodes + 1, 2 * c.nodes) if n > c.nodes]
    built = 0
    for config in tries:
        if built == max_tries:
            break
        if lower_bound(run, with_precision(config, precisions[-1]), hardware) is None:
            continue  # not even at the least optimizer state
        built += 1
        found = evaluation_or_reason(run, config, hardware)
        if not isinstance(found, Evaluation):
            continue
        for precision in precisions:  # the same schedule: only the memory is planned again
            found = repriced(run, found, precision, hardware)
            if found.fits:
                return simulated(run, found, hardware)
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
    # host bytes per parameter of the optimizer-state precisions where nothing fitted, in
    # the order searched (the candidates, if any, are at the next of cheaper_precisions)
    nothing_fits_at: tuple[int, ...] = ()


def searched_updates(run: RunConfig, hardware: HardwareProfile) -> tuple[DeviceShare, ...]:
    """The device shares of the optimizer updates to compare: the run's without device
    subgroups (all on the CPU, or the static split when asked for), and, from there,
    auto_split's split for the profile (Eq. 1's stride k, or the GPU-heavy split where
    k < 1; when it has the device rates)."""
    plain = plain_updates(run.cpu_optimizer.placement.updates)
    rates = update_rates(hardware)
    if rates is None or plain.uses_device:
        return (plain,)
    split = auto_split(rates).split
    return (plain, Interleaved(split)) if split else (plain,)


def searched_configurations(run: RunConfig, hardware: HardwareProfile,
                            precision: Precision = (None, None)) -> list[Configuration]:
    """schedule x forward stages (the schedule's searched stages per rank) x d (1..3 where
    its backward stages split) x micro-batch sizes dividing the global batch, all on the
    CPU optimizer (the device subgroups are tried per shape), with the optimizer state in
    `precision` (None: the run's)."""
    nodes = run.planning.nodes or 1
    ranks = nodes * gpus_per_node(run, hardware)
    layers = run.model.num_layers
    plain = plain_updates(run.cpu_optimizer.placement.updates)
    sizes = [m for m in (1, 2, 4, 8, 16)
             if batch_divides(run, Configuration(DEFAULT_SCHEDULE, None, None, m, nodes))]
    found = []
    for kind in SCHEDULE_KINDS.values():
        splits = (1, 2, 3) if kind.splits_backward else (1,)
        for k in kind.searched_stages_per_rank:
            stages = k * ranks
            if stages > layers:
                continue
            found += [Configuration(kind.name, stages, d, mbs, nodes, plain, *precision)
                      for d in splits if d * stages <= layers for mbs in sizes]
    return found


def search(run: RunConfig, hardware: HardwareProfile, top: int = SEARCH_TOP,
           workers: int | None = None) -> SearchResult:
    """The fastest configurations at the given nodes and global batch that fit, with the
    run's optimizer-state precision or, when nothing fits with it, the first of
    `cheaper_precisions` with which something does (see `search_at`)."""
    tried: list[int] = []
    for precision in [(None, None), *cheaper_precisions(run)]:
        found = search_at(run, hardware, precision, top, workers)
        if found.ranked:
            break
        tried.append(optimizer_bytes(run, Configuration(DEFAULT_SCHEDULE, None, None, 1, 1,
                                                        ON_HOST, *precision)))
    return replace(found, nothing_fits_at=tuple(tried))


def search_at(run: RunConfig, hardware: HardwareProfile, precision: Precision,
              top: int = SEARCH_TOP, workers: int | None = None) -> SearchResult:
    """The fastest configurations at the given nodes, global batch and optimizer-state
    precision that fit, exactly as if every one were simulated: each shape's lower bounds
    (memory and time, from its shape alone) set aside what cannot fit, then shapes are
    built in order of their time bound, `workers` at a time (default: the cores this rank
    may use), until the next bound is above the `top`-th fastest found. A built shape is
    simulated with each device share of `searched_updates`. The ranked evaluations
    keep their schedule's shape, not its programs, and their simulation's figures, not its
    events."""
    shapes = searched_configurations(run, hardware, precision)
    shares = searched_updates(run, hardware)
    bounded = []
    for config in shapes:
        bound = lower_bound(run, config, hardware)
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
                                       [(run, config, shares, hardware) for config in wave]):
                ranked += evaluations
            ranked.sort(key=rank_key)
    return SearchResult(ranked, len(shapes) * len(shares),
                        (len(shapes) - len(bounded)) * len(shares),
                        (len(bounded) - built) * len(shares), built * len(shares))


def rank_key(evaluation: Evaluation) -> tuple[float, str]:
    """Fastest first; equal predictions in the order of their flags, so that the ranking
    does not depend on the order the configurations were built in."""
    return evaluation.simulation.iteration_time, evaluation.config.flags()


def evaluate_shape(job: tuple) -> list[Evaluation]:
    """One shape's fitting evaluations, simulated, light enough to come back from a worker.
    A split is kept only where it is predicted faster than every update on the CPU (where
    no update is exposed it changes nothing but the device memory it takes)."""
    run, config, shares, hardware = job
    out: list[Evaluation] = []
    for evaluation in _with_each(run, config, shares, hardware):
        if not evaluation.fits:
            continue
        evaluation = simulated(run, evaluation, hardware)
        if out and evaluation.simulation.iteration_time >= out[0].simulation.iteration_time:
            continue
        evaluation.schedule = replace(evaluation.schedule, programs=())
        evaluation.simulation = replace(evaluation.simulation, events=())
        out.append(evaluation)
    return out


def _with_each(run: RunConfig, config: Configuration, shares: tuple[DeviceShare, ...],
               hardware: HardwareProfile) -> list[Evaluation]:
    """`config` evaluated (memory only) with each device share, its programs built and
    checked once."""
    plain = evaluation_or_reason(run, config, hardware)
    if isinstance(plain, Unbuildable):
        return []
    out = [plain]
    for updates in shares:
        if updates.marks_exposed_stages:
            placed = with_subgroups(run, plain, updates, hardware)
            if placed.schedule.programs != plain.schedule.programs:  # else the same run
                out.append(placed)
    return out


def auto_configure(run: RunConfig, hardware: HardwareProfile,
                   found: SearchResult | None = None) -> tuple[RunConfig, SearchResult]:
    """`run` with the fastest fitting configuration, and what the search compared."""
    found = search(run, hardware) if found is None else found
    if not found.ranked:
        least = min(found.nothing_fits_at, default=run.precision.optimizer_bytes_per_param)
        raise ConfigError("--auto-config", "", "no configuration of this model fits "
                          f"{run.planning.nodes or 1} node(s) of {hardware.name}, not even with "
                          f"{least} bytes of optimizer state per parameter; see --plan")
    return configured(run, found.ranked[0].config, keep_partition=False), found
