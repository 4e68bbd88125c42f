"""What `--plan`, `--auto-config` and `--print-model-size` print: tables of memory per GPU
and per node, whether the run fits and what to change if not, the candidates compared,
on one GPU the largest LLaMA-2 shape it trains (largest.py), the model's size. Text for people, one JSON object with --json.
"""

from __future__ import annotations

import json

from megatron.config.model import (
    MODEL_STATE_BYTES_PER_PARAM,
    count_parameters_full_mha,
)
from megatron.config.run import RunConfig
from megatron.schedules.hardware import HardwareProfile, shape_differences
from megatron.schedules.memory_model import GPU_TERMS, NODE_TERMS, pinning_shortfall

from .evaluate import Evaluation, plan_hardware
from .largest import largest_model, largest_text
from .run_plan import RunPlan, plan_on_profile
from .search import (
    SEARCH_TOP,
    SearchResult,
    auto_configure,
    nearest_fit,
    precision_note,
    search,
)

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3
GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def _table(title: str, names: tuple[str, ...], rows: list[tuple[str, dict, int | None]],
           capacity_label: str) -> list[str]:
    """Columns as wide as their whole header (a cut header reads as another word); a
    capacity of None or 0 (not known, not bounded) prints as '-'."""
    headers = [n.replace("_", " ") for n in names]
    widths = [max(len(h), 8) + 2 for h in headers]
    head = f"{title:<10}" + "".join(f"{h:>{w}}" for h, w in zip(headers, widths))
    lines = [head + f"{'total':>10}{capacity_label:>10}"]
    for label, terms, capacity in rows:
        total = sum(terms.values())
        lines.append(f"{label:<10}" + "".join(f"{_gib(terms[n]):>{w}}"
                                              for n, w in zip(names, widths))
                     + f"{_gib(total):>10}" + (f"{_gib(capacity):>10}" if capacity else
                                               f"{'-':>10}"))
    return lines


def describe(run: RunConfig, plan: RunPlan) -> str:
    """The plan as --plan prints it, and the run at its start (on its own machine)."""
    s, c, m, hardware = plan.schedule, plan.config, plan.memory, plan.hardware
    machine = hardware.name if hardware is not None else "this machine, no profile"
    lines = [f"plan: {run.model.name} model on {c.nodes} node(s) x {plan.where.procs_per_node} "
             f"GPUs ({machine}), {s.name}, {s.forward_stages} forward stages, "
             f"d={s.backward_split}, {s.micro_batches} micro-batches of {c.micro_batch_size} x "
             f"{run.model.seq_length} tokens, {run.precision.dtype}, optimizer state "
             f"{plan.optimizer_bytes_per_param} bytes per parameter (m and v "
             f"{run.precision.optimizer_state_dtype}, master {run.precision.master_dtype})",
             "memory in GiB" + ("" if run.model.vocab_size else
                                f" (vocabulary {run.model.planned_vocab_size} assumed: give "
                                "--vocab-size)")]
    cap = plan.capacity
    lines += _table("per GPU", GPU_TERMS, [(f"rank {r}", t, cap.gpu)
                                           for r, t in enumerate(m.per_gpu)], "free")
    lines += _table("per node", NODE_TERMS, [(f"node {n}", t, cap.host)
                                             for n, t in enumerate(m.per_node)], "host")
    shm = max(t["shm_parameters"] for t in m.per_node)
    lines.append(f"/dev/shm: {shm / GIB:.2f} GiB of {cap.shm / GIB:.2f} GiB "
                 "on the fullest node")
    over = pinning_shortfall(m, hardware) if plan.where.against_profile else 0
    if over:
        lines.append(f"memlock: the pinned gradient buffers exceed ulimit -l by {over / GIB:.2f} "
                     "GiB; they fall back to pageable memory (slower copies): raise ulimit -l")
    if plan.fits:
        lines.append("fits: yes")
    else:
        worst = {}
        for short in plan.missing:  # the worst of each resource (they come sorted)
            worst.setdefault(short.resource, short)
        for short in worst.values():
            lines.append(f"fits: no: {short.resource} on {short.where} needs "
                         f"{short.needed / GIB:.2f} GiB, {short.available / GIB:.2f} GiB there "
                         f"({short.missing / GIB:.2f} GiB short)")
    if plan.split_note:
        lines.append(("" if plan.rank is None else f"rank {plan.rank}: ") + plan.split_note)
    if plan.simulation is not None:
        sim = plan.simulation
        lines.append(f"predicted iteration {sim.iteration_time:.3f} s, MFU {plan.mfu:.3f}, "
                     f"bubble ratio {sim.mean_bubble_ratio:.3f}, exposed optimizer "
                     f"{sim.exposed_optimizer_time:.3f} s")
        if m.disk_per_node:
            keeps_up = ("keeps up" if sim.state_io_busy_time <= sim.iteration_time
                        else "does not keep up")
            lines.append(f"optimizer states on NVMe: {max(m.disk_per_node) / GIB:.2f} GiB per "
                         f"node (two versions) of {cap.nvme / GIB:.2f} GiB; "
                         f"the drive {keeps_up}: busy {sim.state_io_busy_time:.3f} s per "
                         f"iteration, {sim.exposed_state_io_time:.3f} s after the last compute")
    elif hardware is None:
        lines.append("predicted iteration: none (give --hardware FILE, this machine's profile "
                     "from tools/profile_hardware.py)")
    return "\n".join(lines + (profile_notes(run, hardware) if hardware is not None else []))


def mfu_basis(hardware: HardwareProfile) -> str:
    return "datasheet peak" if hardware.mfu_against_datasheet else "measured peak rate"


def profile_notes(run: RunConfig, hardware: HardwareProfile) -> list[str]:
    """What a user must know to trust the predictions: an MFU that is not against the
    datasheet, and compute measured at another layer than the model's."""
    notes = []
    if not hardware.mfu_against_datasheet:
        notes.append(f"MFU is against the profile's measured peak rate "
                     f"({hardware.gpu_peak_flops / 1e12:.3g} TFLOP/s per GPU): the device's "
                     "datasheet peak is unknown (datasheet_peak_flops)")
    differences = shape_differences(hardware, run.model)
    if differences:
        notes.append(f"the profile measured compute at another layer shape "
                     f"({', '.join(differences)}): the compute times are extrapolated; "
                     "profile with this model's flags (tools/profile_hardware.py --help)")
    return notes


def nearest_text(run: RunConfig, nearest: Evaluation | None) -> str:
    """The suggestion --plan prints when the run does not fit: the flags, what a cheaper
    optimizer state changes, and the prediction there."""
    if nearest is None:
        return "nearest configuration that fits: none one knob away"
    sim, note = nearest.simulation, precision_note(run, nearest.config)
    return (f"nearest configuration that fits: {nearest.config.flags()}"
            + (f" ({note})" if note else "")
            + f"; predicted iteration {sim.iteration_time:.3f} s, MFU {nearest.mfu:.3f}")


def candidates_text(found: SearchResult, top: int = SEARCH_TOP) -> str:
    ranked = found.ranked
    lines = [f"auto-config: nothing fits with {b} bytes of optimizer state per parameter"
             for b in found.nothing_fits_at]
    if ranked and ranked[0].config.precision_flags():
        lines.append(f"auto-config: searched with {' '.join(ranked[0].config.precision_flags())}"
                     f" ({ranked[0].optimizer_bytes_per_param} bytes per parameter)")
    lines += [f"auto-config: {found.configurations} configurations: {found.cannot_fit} cannot "
             f"fit, {found.cannot_win} cannot beat the fastest {top} (lower bounds), "
             f"{found.built} simulated; the fastest {min(top, len(ranked))}:"]
    for i, e in enumerate(ranked[:top]):
        sim = e.simulation
        lines.append(f"  {i + 1}. {e.config.flags():<90} iteration {sim.iteration_time:.3f} s, "
                     f"MFU {e.mfu:.3f}, bubble {sim.mean_bubble_ratio:.3f}, exposed optimizer "
                     f"{sim.exposed_optimizer_time:.3f} s")
    return "\n".join(lines)


def run_plan(run: RunConfig) -> int:
    """Print the plan (or, with --json, one JSON object); 0 when it fits, 3 when not."""
    hardware = plan_hardware(run)
    candidates = SearchResult([], 0, 0, 0, 0)
    if run.planning.auto_config:
        candidates = search(run, hardware)
        if candidates.ranked:
            run, _ = auto_configure(run, hardware, found=candidates)
    plan = plan_on_profile(run, hardware)
    nearest = None if plan.fits else nearest_fit(run, plan.evaluation(), hardware)
    # On one GPU, the next question is which model it trains (well under a second)
    one_gpu = plan.schedule.ranks == 1
    largest = largest_model(run, hardware) if one_gpu else None
    if run.planning.json:
        out = {"fits": plan.fits, "hardware": hardware.name,
               "mfu_against": mfu_basis(hardware),
               "compute_shape_differences": shape_differences(hardware, run.model),
               "configuration": plan.summary(),
               "per_gpu": [dict(t, rank=r) for r, t in enumerate(plan.memory.per_gpu)],
               "per_node": [dict(t, node=n) for n, t in enumerate(plan.memory.per_node)],
               "capacity": {"gpu_free": plan.capacity.gpu or 0, "host": plan.capacity.host,
                            "shm": plan.capacity.shm}}
        if plan.split_note:
            out["optimizer_split"] = plan.split_note
        if not plan.fits:
            worst = plan.missing[0]
            out.update(resource=worst.resource, where=worst.where, needed=worst.needed,
                       available=worst.available, short_by=worst.missing,
                       shortfalls=[vars(s) | {"short_by": s.missing} for s in plan.missing],
                       nearest_fit=nearest.summary() if nearest else None)
        if largest is not None:
            out["largest_model"] = largest.summary()
        if run.planning.auto_config:
            out["candidates"] = [e.summary() for e in candidates.ranked[:SEARCH_TOP]]
            out["search"] = {"configurations": candidates.configurations,
                             "cannot_fit": candidates.cannot_fit,
                             "cannot_win": candidates.cannot_win, "built": candidates.built,
                             "nothing_fits_at": list(candidates.nothing_fits_at)}
        print(json.dumps(out, indent=1))
    else:
        if run.planning.auto_config:
            print(candidates_text(candidates))
        print(describe(run, plan))
        if not plan.fits:
            print(nearest_text(run, nearest))
        if largest is not None:
            print(largest_text(run, hardware, largest))
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


def model_size(run: RunConfig) -> str:
    """--print-model-size: the parameter count and what its states take in memory."""
    m, p = run.model, run.precision
    vocab = m.planned_vocab_size
    c = m.parameters()
    mha = count_parameters_full_mha(m.num_layers, m.hidden_size, m.ffn_hidden_size, vocab)
    gib = c.total * MODEL_STATE_BYTES_PER_PARAM / 2**30
    optimizer = p.optimizer_bytes_per_param
    return "\n".join([
        f"model: {m.name}  layers={m.num_layers} hidden={m.hidden_size} ffn={m.ffn_hidden_size} "
        f"heads={m.num_attention_heads} kv_heads={m.num_query_groups} vocab={vocab}",
        f"parameters: {c.total:,} ({c.total / 1e9:.2f} B): embedding {c.embedding:,}, "
        f"{m.num_layers} layers x {c.per_layer:,}, head {c.head:,}",
        f"model states (mixed-precision Adam, {MODEL_STATE_BYTES_PER_PARAM} bytes/param): "
        f"{gib:,.1f} GiB",
        f"with full multi-head attention (the paper's size column): {mha / 1e9:.2f} B",
        f"host optimizer state (master {p.master_dtype}, m and v {p.optimizer_state_dtype}): "
        f"{optimizer} bytes/param, {c.total * optimizer / 2**30:,.1f} GiB"])
