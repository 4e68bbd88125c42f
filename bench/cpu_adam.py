"""The CPU optimizer's step on every ISA this machine runs, against torch's fused AdamW
and the streaming bandwidth of the step's own bytes.

    python bench/cpu_adam.py [--params N] [--threads T] [--repeats R] [--calls K] [--json]

Every ratio is PAIRED: taken within one round, then summarised over the rounds (median,
quartiles q1-q3, min, max, samples), so that the machine's drift between rounds minutes
apart cancels out of it. R rounds (default 32; at least one per group below): every round
runs the TARGETS group (the best ISA's four steps, their in-cache rates, their touch
probes with and without streaming stores, torch's fused AdamW) and one other group in turn
(each other ISA, the knobs of each precision, the thread scaling, CPUAdamW, torch's
compositions), each group's variants back to back in a shuffled order (fixed seed), the
two groups in a random order; each variant is called K times in a row (default 2) and
keeps its fastest call of the round (on a shared machine a call is only ever slowed
down). After one warm-up call of each. Per variant: `params_per_s`, `gb_s` (median, min,
max over its rounds). Every variant names its ISA and its threads; `groups` lists them.

Steps of the C++ kernel (bf16 gradient in, bf16 working copy out, no loss scale: a bf16
run), on every ISA of available_isas() (portable, avx2, avx512 where the CPU has it):
- fp32: fp32 master, m and v: 28 bytes per parameter (p, m, v read and written, the
  gradient read, the copy written);
- bf16_states: bf16 m and v (--optimizer-state-dtype bf16): 20 bytes;
- bf16_all: bf16 m, v and master, stochastic rounding (--master-dtype bf16): 16 bytes;
- bf16_all_nearest: the same, the master rounded to nearest (--master-rounding nearest).
Each has its stream probe, `stream/<precision>`: the kernel's touch op, which moves the
step's bytes as raw words (no conversion, no arithmetic) on the same threads: the
streaming bandwidth for those bytes. `fraction_of_stream` is a step's rate over its
probe's of the same round; both store the working copy as the kernel does by default
(non-temporally where aligned, `stream_out`), `stream_cached/` through the cache (its line is
read first: 2 bytes per parameter more than the nominal ones).
Each also runs `in_cache` on every ISA: the same step on one thread over 131072 elements
at a time (inside the last-level cache), as many calls as make N parameter-steps: the
instructions' cost of each precision with no memory limit (`*_in_cache_ns_per_param`,
`*_over_fp32_in_cache`), beside the byte limit above.
On the best ISA also:
- fp16_loss_scaled: fp32 states, fp16 gradient and copy, loss scale 1024 (unscaled in
  the step);
- cpu_adamw: the fp32 step through CPUAdamW (what training calls: the kernel plus its
  bookkeeping); exact: the same in exact-rollback mode (snapshots 12 more bytes: 40);
  step_and_rollback: a step and its arithmetic rollback (`rollback_alone_params_per_s`:
  the pair's time minus the step's);
- same_work: our kernel on torch_fused_adamw's inputs and outputs (fp32 gradient, no
  copy: the same 28 bytes; ours still checks the gradient and sums its squares);
- the kernel's speed knobs on each precision (prefetch off / 1024, streaming stores of
  the copy, blocks of 8k / 256k elements, a static split of the blocks among the threads,
  threads pinned to cores 0..T-1).
`params_per_cpu_s` (parameters per second of the process's CPU time, median) is the
cost per core-second: on a machine shared with other jobs it moves less than the wall
rate when the threads wait for a core; `per_isa_cpu` gives the per-ISA ratios on it,
`overlap_cpu` whether a step pays the larger or the sum of its byte and instruction costs
(torch's OpenMP threads sleep between ops here: OMP_WAIT_POLICY=PASSIVE unless set).
References: torch_fused_adamw (torch.optim.AdamW(fused=True) on fp32 gradients, 28 bytes),
torch_composed (copy_ to fp32, torch.amp's unscale-and-check, fused AdamW, copy_ out;
_isfinite: mul_ and isfinite().all() as the check), DeepSpeedCPUAdam in the composed step
when it imports, triad (torch.add(a, b, out=c), 12 bytes per element).
Threads: fp32 and bf16_all on the best ISA, their probes and torch's fused AdamW at 1..T.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# torch's OpenMP threads spin for a while after each op; in an interleaved round they
# would take the cores from whatever variant runs next (a pinned kernel thread cannot
# move away) and count their spinning in its CPU time. Passive: they sleep at once (a
# wake-up of microseconds against a step of milliseconds). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine  # noqa: E402
from bench.spread import spread  # noqa: E402
from megatron.optimizer import CPUAdamW, available_isas, kernel_tuning  # noqa: E402
from megatron.optimizer import _cpu_adam as _kernel  # noqa: E402
from megatron.optimizer.adam_kernel import usable_cores  # noqa: E402
from megatron.optimizer.worker_pool import shared_pool  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.1
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Precision:
    master: torch.dtype
    states: torch.dtype
    stochastic: bool
    bytes_per_param: int


PRECISIONS = {
    "fp32": Precision(torch.float32, torch.float32, False, 28),
    "bf16_states": Precision(torch.float32, BF16, False, 20),
    "bf16_all": Precision(BF16, BF16, True, 16),
    "bf16_all_nearest": Precision(BF16, BF16, False, 16),
}
# Kernel knobs tried on the best ISA (megatron.optimizer.kernel_tuning); "pinned" pins the
# kernel threads to cores 0..T-1 instead.
KNOBS: dict[str, dict] = {
    "prefetch_0": {"prefetch": 0},
    "prefetch_1024": {"prefetch": 1024},
    "cached_out": {"stream_out": False},
    "block_8k": {"block": 8192},
    "block_256k": {"block": 262144},
    "static_split": {"static_split": True},
    "pinned": {},
}
IN_CACHE = 131072  # elements: 3.7 MB of fp32 step traffic, inside a 32 MB L3
CODES = {torch.float32: _kernel.F32, torch.float16: _kernel.F16, BF16: _kernel.BF16}
TARGETS = "targets"  # the group of variants that runs in every round


@dataclass
class Variant:
    run: Callable[[], object]
    isa: str
    threads: int
    bytes_per_param: int | None
    params: int | None = None  # parameter-steps per run when not the bench's n


class StepBuffers:
    """p, m, v, a bf16 gradient and a bf16 working copy of one precision; every ISA and
    thread count steps the same buffers (the touch probe leaves p, m, v as they were)."""

    def __init__(self, n: int, precision: Precision, gen: torch.Generator) -> None:
        self.n, self.precision = n, precision
        self.p = torch.randn(n, generator=gen).to(precision.master)
        self.m = torch.zeros(n, dtype=precision.states)
        self.v = torch.zeros(n, dtype=precision.states)
        self.grad = torch.randn(n, generator=gen).to(BF16)
        self.out = torch.empty(n, dtype=BF16)
        self.format = _kernel.StateFormat()
        self.format.master_dtype = CODES[precision.master]
        self.format.state_dtype = CODES[precision.states]
        if precision.stochastic:
            self.format.runs = [[0, n, 0, 0x5EED]]
        self.steps = 0

    def common(self, threads: int, isa: str, cores: Sequence[int] = ()) -> dict:
        return dict(p=self.p.data_ptr(), m=self.m.data_ptr(), v=self.v.data_ptr(),
                    grad=self.grad.data_ptr(), grad_dtype=_kernel.BF16, out=self.out.data_ptr(),
                    out_dtype=_kernel.BF16, n=self.n, pool=shared_pool(threads, cores), isa=isa,
                    format=self.format)

    def step(self, threads: int, isa: str, cores: Sequence[int] = ()) -> Callable[[], object]:
        """One step (cores: pin the kernel threads; none: unpinned)."""
        def run() -> object:
            self.steps += 1
            return _kernel.step(**self.common(threads, isa, cores), snapshot=0, lr=LR,
                                beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                                step=self.steps, inv_scale=1.0)
        return run

    def stream(self, threads: int, isa: str, non_temporal: bool | None = None
               ) -> Callable[[], object]:
        """The touch probe; non_temporal None: the working copy stored as the steps store
        it (the kernel's setting)."""
        def run() -> object:
            with kernel_tuning(stream_out=non_temporal):
                return _kernel.touch(**self.common(threads, isa))
        return run


def in_cache(n: int, precision: Precision, isa: str, gen: torch.Generator) -> Variant:
    """n element-steps on one thread as steps of IN_CACHE elements (their 4 MiB or less
    stay in the last-level cache): the instructions' cost of the step, no memory limit."""
    buf = StepBuffers(IN_CACHE, precision, gen)
    step = buf.step(1, isa)
    calls = max(n // IN_CACHE, 1)

    def run() -> None:
        for _ in range(calls):
            step()
    return Variant(run, isa, 1, None, calls * IN_CACHE)


def tuned(step: Callable[[], object], knobs: dict) -> Callable[[], object]:
    def run() -> object:
        with kernel_tuning(**knobs):
            return step()
    return run


def cpu_adamw_step(n: int, threads: int, gen: torch.Generator, *, grad_dtype: torch.dtype,
                   scale: float = 1.0, out: bool = True, exact: bool = False,
                   rollback: bool = False) -> Callable[[], None]:
    """A step of CPUAdamW (fp32 states) on the best ISA; rollback=True: step and rollback."""
    opt = CPUAdamW([torch.randn(n, generator=gen)], lr=LR, betas=BETAS, eps=EPS,
                   weight_decay=WD, threads=threads, exact_rollback=exact)
    grad = (torch.randn(n, generator=gen) * scale).to(grad_dtype)
    copy = torch.empty(n, dtype=grad_dtype) if out else None

    def run() -> None:
        opt.step_group(0, grad, inv_scale=1.0 / scale, out=copy)
        (opt.rollback_group if rollback else opt.commit_group)(0)
    return run


def torch_threads(threads: int, call: Callable[[], object]) -> Callable[[], object]:
    """Runs `call` with torch's intra-op threads set to `threads` (process-wide)."""
    def run() -> object:
        torch.set_num_threads(threads)
        return call()
    return run


def torch_fused_step(n: int, gen: torch.Generator) -> Callable[[], object]:
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.randn(n, generator=gen)
    return torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             fused=True).step


def composed_step(n: int, gen: torch.Generator, make_optimizer, check: str = "amp"
                  ) -> Callable[[], None]:
    """bf16 grad -> fp32 copy -> unscale+check -> optimizer step -> bf16 copy. check="amp":
    torch.amp's fused unscale-and-check op; "isfinite": mul_ then isfinite(g).all()."""
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.empty(n)
    grad16 = torch.randn(n, generator=gen).to(BF16)
    out = torch.empty(n, dtype=BF16)
    found_inf, inv_scale = torch.zeros(1), torch.tensor(1.0)
    opt = make_optimizer(param)

    def finite() -> bool:
        if check == "isfinite":
            param.grad.mul_(1.0)
            return bool(torch.isfinite(param.grad).all())
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inv_scale)
        return found_inf.item() == 0.0

    def run() -> None:
        param.grad.copy_(grad16)
        if finite():
            opt.step()
        out.copy_(param)
    return run


def fused_adamw(param: torch.nn.Parameter) -> torch.optim.Optimizer:
    return torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def deepspeed_step(n: int, gen: torch.Generator) -> tuple[Callable[[], None] | None, str | None]:
    """DeepSpeedCPUAdam in the composed step, or None and why it cannot run."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        step = composed_step(n, gen, lambda p: DeepSpeedCPUAdam(
            [p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True))
        step()  # builds the extension on first use
        return step, None
    except Exception as error:  # noqa: BLE001 - any failure to import or build is the answer
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:300]


def triad_step(n: int) -> Callable[[], object]:
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    return lambda: torch.add(a, b, out=c)


Rounds = dict[str, dict[int, float]]  # variant -> round -> seconds


def seconds_interleaved(groups: dict[str, dict[str, Variant]], rounds: int, calls: int
                        ) -> tuple[Rounds, Rounds]:
    """Wall and process CPU seconds of each variant, by round. Every round runs the
    TARGETS group and one other group in turn (round r: the (r mod G)-th), each group's
    variants back to back in a shuffled order (fixed seed) and the two groups in a random
    order: a ratio of two variants is taken within one round (paired), so the machine's
    drift between rounds minutes apart cancels, and no variant always follows the same one
    (torch's OpenMP threads spin for a while after an op and slow down what follows).
    Each variant is called `calls` times in a row and keeps its fastest: on a shared
    machine a call is only ever slowed down (a thread waiting for a core), never sped up."""
    for group in groups.values():
        for variant in group.values():
            variant.run()  # warm-up: page faults, thread pools
    others = [name for name in groups if name != TARGETS]
    wall: Rounds = {name: {} for group in groups.values() for name in group}
    cpu: Rounds = {name: {} for name in wall}
    order = random.Random(0)
    for r in range(rounds):
        blocks = [TARGETS] + ([others[r % len(others)]] if others else [])
        order.shuffle(blocks)
        for block in blocks:
            names = list(groups[block])
            order.shuffle(names)
            for name in names:
                for _ in range(calls):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    groups[block][name].run()
                    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
                    wall[name][r] = min(wall[name].get(r, seconds), seconds)
                    cpu[name][r] = min(cpu[name].get(r, cpu_seconds), cpu_seconds)
    return wall, cpu


def build_variants(n: int, threads: int, gen: torch.Generator
                   ) -> tuple[dict[str, dict[str, Variant]], str | None]:
    """The variants in groups: TARGETS (run every round: the best ISA's steps, their
    probes and in-cache rates, torch's fused AdamW) and the others (one a round, in turn:
    each other ISA, the knobs of each precision, the thread scaling, CPUAdamW, torch's
    compositions)."""
    isas, best = available_isas(), available_isas()[-1]
    buffers = {name: StepBuffers(n, p, gen) for name, p in PRECISIONS.items()}
    groups: dict[str, dict[str, Variant]] = {TARGETS: {}}
    targets = groups[TARGETS]
    for isa in isas:
        group = targets if isa == best else groups.setdefault(isa, {})
        for name, buf in buffers.items():
            group[f"{isa}/{name}"] = Variant(buf.step(threads, isa), isa, threads,
                                             buf.precision.bytes_per_param)
            group[f"{isa}/{name}/in_cache"] = in_cache(n, buf.precision, isa, gen)
    for name, buf in buffers.items():
        nbytes = buf.precision.bytes_per_param
        targets[f"stream/{name}"] = Variant(buf.stream(threads, best), best, threads, nbytes)
        targets[f"stream_cached/{name}"] = Variant(buf.stream(threads, best, False), best,
                                                   threads, nbytes)
        if name != "bf16_all_nearest":
            knobs = groups[f"knobs/{name}"] = {}
            for knob, setting in KNOBS.items():
                step = (buf.step(threads, best, usable_cores()[:threads]) if knob == "pinned"
                        else tuned(buf.step(threads, best), setting))
                knobs[f"{best}/{name}/{knob}"] = Variant(step, best, threads, nbytes)
    fused = torch_fused_step(n, gen)
    targets["torch_fused_adamw"] = Variant(torch_threads(threads, fused), "torch", threads, 28)
    if threads > 1:
        scaling = groups["threads"] = {}
        for t in range(1, threads):  # the scaling; T threads itself is in TARGETS
            for name in ("fp32", "bf16_all"):
                nbytes = PRECISIONS[name].bytes_per_param
                scaling[f"{best}/{name}@{t}"] = Variant(buffers[name].step(t, best), best, t, nbytes)
                scaling[f"stream/{name}@{t}"] = Variant(buffers[name].stream(t, best), best, t,
                                                        nbytes)
            scaling[f"torch_fused_adamw@{t}"] = Variant(torch_threads(t, fused), "torch", t, 28)
    training = groups["cpu_adamw"] = {}
    training[f"{best}/fp16_loss_scaled"] = Variant(cpu_adamw_step(
        n, threads, gen, grad_dtype=torch.float16, scale=1024.0), best, threads, 28)
    training[f"{best}/cpu_adamw"] = Variant(cpu_adamw_step(n, threads, gen, grad_dtype=BF16),
                                            best, threads, 28)
    training[f"{best}/exact"] = Variant(cpu_adamw_step(n, threads, gen, grad_dtype=BF16,
                                                       exact=True), best, threads, 40)
    training[f"{best}/step_and_rollback"] = Variant(cpu_adamw_step(
        n, threads, gen, grad_dtype=BF16, rollback=True), best, threads, None)
    training[f"{best}/same_work"] = Variant(cpu_adamw_step(
        n, threads, gen, grad_dtype=torch.float32, out=False), best, threads, 28)
    composed = groups["torch"] = {}
    composed["torch_composed"] = Variant(torch_threads(threads, composed_step(
        n, gen, fused_adamw)), "torch", threads, None)
    composed["torch_composed_isfinite"] = Variant(torch_threads(threads, composed_step(
        n, gen, fused_adamw, "isfinite")), "torch", threads, None)
    composed["triad"] = Variant(torch_threads(threads, triad_step(n)), "torch", threads, 12)
    torch.set_num_threads(threads)
    deepspeed, deepspeed_error = deepspeed_step(n, gen)
    if deepspeed is not None:
        composed["deepspeed"] = Variant(torch_threads(threads, deepspeed), "deepspeed", threads,
                                        None)
    return groups, deepspeed_error


def summarize(n: int, variants: dict[str, Variant], times: Rounds, cpu_times: Rounds) -> dict:
    out = {}
    for name, variant in variants.items():
        rates = [(variant.params or n) / t for t in times[name].values()]
        row = {"isa": variant.isa, "threads": variant.threads,
               "bytes_per_param": variant.bytes_per_param, "params_per_s": spread(rates),
               "params_per_cpu_s": (variant.params or n) / max(
                   statistics.median(cpu_times[name].values()), 1e-9)}
        if variant.bytes_per_param:
            row["gb_s"] = spread([r * variant.bytes_per_param / 1e9 for r in rates])
        out[name] = row
    return out


class PairedRates:
    """Per-round rates (parameter-steps per second) of every variant, and the ratio of two
    variants taken round by round: over the rounds that ran both, the median, quartiles,
    min and max of (a's rate / b's rate) in the same round."""

    def __init__(self, n: int, variants: dict[str, Variant], seconds: Rounds) -> None:
        self.rate = {name: {r: (v.params or n) / max(t, 1e-12) for r, t in seconds[name].items()}
                     for name, v in variants.items()}

    def per_round(self, a: str, b: str) -> list[float]:
        return [x / self.rate[b][r] for r, x in self.rate[a].items() if r in self.rate[b]]

    def ratio(self, a: str, b: str) -> dict:
        return spread(self.per_round(a, b), quartiles=True)


def per_isa_ratios(rates: PairedRates, isas: Sequence[str]) -> dict:
    """Per ISA, paired: the 16-bit steps over the fp32 step, the fp32 step over torch's
    fused AdamW, each step over its stream probe of the same round; the targets on the
    ratios' medians."""
    per_isa = {}
    for isa in isas:
        r = {"fp32_over_torch_fused": rates.ratio(f"{isa}/fp32", "torch_fused_adamw")}
        for name in PRECISIONS:
            if name != "fp32":
                r[f"{name}_over_fp32"] = rates.ratio(f"{isa}/{name}", f"{isa}/fp32")
                r[f"{name}_over_fp32_in_cache"] = rates.ratio(f"{isa}/{name}/in_cache",
                                                              f"{isa}/fp32/in_cache")
            r[f"{name}_in_cache_ns_per_param"] = 1e9 / statistics.median(
                rates.rate[f"{isa}/{name}/in_cache"].values())
            r[f"{name}_fraction_of_stream"] = rates.ratio(f"{isa}/{name}", f"stream/{name}")
            r[f"{name}_fraction_of_stream_cached"] = rates.ratio(f"{isa}/{name}",
                                                                 f"stream_cached/{name}")
        med = {key: value["median"] for key, value in r.items() if isinstance(value, dict)}
        r["targets_met"] = {
            "bf16_states_over_fp32 >= 1.15": med["bf16_states_over_fp32"] >= 1.15,
            "bf16_all_over_fp32 >= 1.40": med["bf16_all_over_fp32"] >= 1.40,
            "fp32_over_torch_fused >= 1.0": med["fp32_over_torch_fused"] >= 1.0,
            **{f"{name}_fraction_of_stream >= 0.8": med[f"{name}_fraction_of_stream"] >= 0.8
               for name in ("fp32", "bf16_states", "bf16_all")},
        }
        per_isa[isa] = r
    return per_isa


def overlap(cpu: PairedRates, isa: str) -> dict:
    """Per precision, paired, on CPU seconds per parameter (they add up over threads, so
    the one-thread in-cache run and the step on T threads compare): the larger of the
    step's byte cost (its stream probe) and its instruction cost (its in-cache run) over
    the step's cost, and their sum over it. larger_over_step near 1: the step overlaps its
    arithmetic with its memory traffic and pays only the larger; sum_over_step near 1: it
    pays both, one after the other."""
    out = {}
    for name in PRECISIONS:
        step, probe, cache = (cpu.rate[f"{isa}/{name}"], cpu.rate[f"stream/{name}"],
                              cpu.rate[f"{isa}/{name}/in_cache"])
        rounds = [r for r in step if r in probe and r in cache]
        out[name] = {
            "larger_over_step": spread([max(1 / probe[r], 1 / cache[r]) * step[r] for r in rounds],
                                       quartiles=True),
            "sum_over_step": spread([(1 / probe[r] + 1 / cache[r]) * step[r] for r in rounds],
                                    quartiles=True)}
    return out


def ratios(n: int, variants: dict[str, Variant], times: Rounds, cpu_times: Rounds,
           isas: Sequence[str], threads: int) -> dict:
    """Every ratio paired within rounds (per_isa: of the wall rates; per_isa_cpu: of the
    rates per CPU second, which a thread waiting for a core on a loaded machine does not
    lower; torch's OpenMP threads count their spinning there); and the thread scaling."""
    wall, cpu = PairedRates(n, variants, times), PairedRates(n, variants, cpu_times)
    best = isas[-1]
    knobs = {f"{name}/{knob}_over_default": wall.ratio(f"{best}/{name}/{knob}", f"{best}/{name}")
             for name in PRECISIONS if name != "bf16_all_nearest" for knob in KNOBS}
    scaling = {}
    for name in (f"{best}/fp32", f"{best}/bf16_all", "stream/fp32", "stream/bf16_all",
                 "torch_fused_adamw"):
        at = {t: name if t == threads else f"{name}@{t}" for t in range(1, threads + 1)}
        scaling[name] = {
            "params_per_s": {t: statistics.median(wall.rate[v].values()) for t, v in at.items()},
            "over_1_thread": {t: wall.ratio(v, at[1]) for t, v in at.items()}}
    # seconds per parameter of the step-and-rollback pair minus the step's, per round
    pair, alone = wall.rate[f"{best}/step_and_rollback"], wall.rate[f"{best}/cpu_adamw"]
    rollback = [1.0 / max(1 / pair[r] - 1 / alone[r], 1e-12) for r in pair if r in alone]
    return {
        "per_isa": per_isa_ratios(wall, isas),
        "per_isa_cpu": per_isa_ratios(cpu, isas),
        "overlap_cpu": overlap(cpu, best),
        "same_work_over_torch_fused": wall.ratio(f"{best}/same_work", "torch_fused_adamw"),
        "fp32_over_torch_composed": wall.ratio(f"{best}/fp32", "torch_composed"),
        "fp32_over_torch_composed_isfinite": wall.ratio(f"{best}/fp32", "torch_composed_isfinite"),
        "fp16_loss_scaled_over_fp32": wall.ratio(f"{best}/fp16_loss_scaled", f"{best}/fp32"),
        "cpu_adamw_over_kernel": wall.ratio(f"{best}/cpu_adamw", f"{best}/fp32"),
        "exact_over_fp32": wall.ratio(f"{best}/exact", f"{best}/cpu_adamw"),
        "rollback_alone_params_per_s": spread(rollback, quartiles=True),
        "knobs": knobs,
        "threads_scaling": scaling,
    }


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=positive_int, default=20_000_000,
                        help="parameters per step (default 20M)")
    parser.add_argument("--threads", type=positive_int, default=len(usable_cores()),
                        help="kernel and torch threads (default: the usable cores)")
    parser.add_argument("--repeats", type=positive_int, default=32,
                        help="rounds (at least one for each group of other variants; "
                             "default 32)")
    parser.add_argument("--calls", type=positive_int, default=2,
                        help="calls of each variant in a round, the fastest kept (default 2)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    n, threads = args.params, args.threads
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    groups, deepspeed_error = build_variants(n, threads, gen)
    rounds = max(args.repeats, len(groups) - 1)
    times, cpu_times = seconds_interleaved(groups, rounds, args.calls)
    variants = {name: v for group in groups.values() for name, v in group.items()}
    results = summarize(n, variants, times, cpu_times)
    isas = available_isas()
    report = {
        "params": n, "threads": threads, "repeats": rounds, "calls": args.calls, "isas": isas,
        "best_isa": isas[-1],
        "machine": machine(load_average_before=load_before,
                           load_average_after=os.getloadavg() if hasattr(os, "getloadavg") else None),
        "statistic": (f"{rounds} rounds; the targets group in every round, each other group in "
                      f"one round of {len(groups) - 1}; in a round, the fastest of {args.calls} "
                      f"calls of a variant; variants: median, min, max over their rounds; "
                      f"ratios: median, quartiles, min, max of the per-round ratio"),
        "groups": {name: sorted(group) for name, group in groups.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "deepspeed_error": deepspeed_error,
        "variants": results,
        "ratios": ratios(n, variants, times, cpu_times, isas, threads),
    }
    if not args.json:
        for name, r in results.items():
            p = r["params_per_s"]
            gb = f"{r['gb_s']['median']:6.1f} GB/s" if "gb_s" in r else ""
            print(f"{name:34s} {r['isa']:9s} {r['threads']:2d} thr  {p['median'] / 1e6:7,.0f} "
                  f"Mparam/s ({p['min'] / 1e6:,.0f}-{p['max'] / 1e6:,.0f})  {gb}  "
                  f"{r['params_per_cpu_s'] / 1e6:,.0f} Mparam/cpu-s")
        best = report["best_isa"]
        print(f"paired ratios on {best}: median [q1-q3] (min-max) of {rounds} rounds")
        for name, r in report["ratios"]["per_isa"][best].items():
            if isinstance(r, dict) and "median" in r:
                print(f"  {name:40s} {r['median']:6.3f} [{r['q1']:.3f}-{r['q3']:.3f}] "
                      f"({r['min']:.3f}-{r['max']:.3f})")
        print(f"  targets met: {report['ratios']['per_isa'][best]['targets_met']}")
        print("thread scaling: Mparam/s by threads (paired ratio over 1 thread)")
        for name, r in report["ratios"]["threads_scaling"].items():
            cells = [f"{t}: {r['params_per_s'][t] / 1e6:,.0f} ({r['over_1_thread'][t]['median']:.2f})"
                     for t in r["params_per_s"]]
            print(f"  {name:24s} " + ", ".join(cells))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
