"""Benchmark of one backward stage's optimizer update: all on the CPU, the static
Twin-Flow split, and interleaved subgroups (Deep Optimizer States) with k from Eq. 1 and
k +/- 1, side by side in one process.

    python bench/optimizer_subgroups.py [--params N] [--subgroup-size S] [--threads T]
                                        [--rounds R] [--json]
    python bench/optimizer_subgroups.py --simulate [--json]

Every round runs each variant once (interleaved, so a disturbance of a shared machine
spreads over all variants); each figure is the median over R rounds after one warm-up,
with the spread (min, max). One step: 16-bit gradient in, unscale, check, AdamW on fp32
master/m/v in host memory, 16-bit working copy out.

- cpu: the C++ kernel over the whole stage.
- twinflow: the first F of the stage's state resident on the device (gradient in,
  16-bit copy out), F chosen so that it holds the same device memory as the interleaved
  variants' two subgroup slots.
- interleaved_k{K} (K = Eq. 1's k, k - 1, k + 1, and 2): every K-th subgroup streamed through the device (p, m, v and the
  gradient in, p, m, v and the 16-bit copy out, two slots), the C++ kernel on the others.

k comes from Eq. 1 over rates calibrated on this machine (B, Ug, Uc, Dc: printed). On the
CPU device layer the "device" is the same cores and "copies" are memory copies: the
figures check the mechanism, they say nothing about a GPU.

--simulate: the simulator instead, on the paper's testbed profile (paper-v100) for the
10b preset (4 ranks, decoupled, 8 forward stages x d = 2, 4 micro-batches of 2 x 2048
tokens): exposed optimizer time per iteration without subgroups, with device subgroups
where the update would be exposed (the placement the runtime uses, here priced by the
same cost model), and on every stage; k from Eq. 1 over the profile's rates (B = 3e9,
and Ug = 35e9, Dc = 8.7e9 params/s as Deep Optimizer States measured them on a V100 node;
Uc the profile's CPU optimizer share per GPU: k = 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.presets import get_preset  # noqa: E402
from megatron.offload.device import get_device  # noqa: E402
from megatron.optimizer import CPUAdamW  # noqa: E402
from megatron.optimizer.subgroups import plan_resident, plan_subgroups  # noqa: E402
from megatron.pipeline.optimizer_calibration import measure_update_rates  # noqa: E402
from megatron.pipeline.subgroup_device import (  # noqa: E402
    DeviceSubgroupUpdater,
    ResidentSubgroupUpdater,
)
from megatron.schedules.cost_model import (  # noqa: E402
    DeviceUpdateCosts,
    backward_stage_params,
    derived_costs,
    get_hardware,
    model_partition,
)
from megatron.schedules.generators import build_schedule  # noqa: E402
from megatron.schedules.hardware import update_rates  # noqa: E402
from megatron.schedules.instructions import Op  # noqa: E402
from megatron.schedules.optimizer_placement import (  # noqa: E402
    exposed_update_stages,
    with_device_subgroups,
)
from megatron.schedules.optimizer_stride import gpu_update_stride  # noqa: E402
from megatron.schedules.simulator import simulate  # noqa: E402


def simulated_10b() -> dict:
    """Exposed optimizer time of the 10b preset on paper-v100, with and without subgroups."""
    preset = get_preset("10b")
    partition = model_partition(preset, 8, min_layers=2)
    schedule = build_schedule("decoupled", 4, 8, 2, 4, partition)
    costs = derived_costs(schedule, preset, "paper-v100", micro_batch_size=2)
    hardware = get_hardware("paper-v100")
    rates = update_rates(hardware)
    stride = gpu_update_stride(rates).k
    params = backward_stage_params(preset, schedule.partition, schedule.backward_split)
    priced = replace(costs, device_update=DeviceUpdateCosts(stride, params, rates))
    exposed = exposed_update_stages(schedule, costs)
    runs = {"cpu_only": schedule,
            "subgroups_on_exposed_tasks_only": with_device_subgroups(
                schedule, exposed_update_stages(schedule, costs, busy_period=False)),
            "subgroups_where_exposed": with_device_subgroups(schedule, exposed),
            "subgroups_everywhere": with_device_subgroups(
                schedule, frozenset(schedule.backward_stages()))}
    result = {"preset": "10b", "hardware": "paper-v100", "schedule": "decoupled 4 ranks, 8 x 2",
              "micro_batches": 4, "micro_batch_size": 2, "stride_k": stride,
              "rates_params_per_s": rates.__dict__,
              "exposed_stages": sorted(tuple(b) for b in exposed), "runs": {}}
    for name, program in runs.items():
        sim = simulate(program, priced)
        result["runs"][name] = {
            "iteration_s": sim.iteration_time, "exposed_optimizer_s": sim.exposed_optimizer_time,
            "device_subgroup_stages": sum(ins.op == Op.OPTIMIZER_START_SUBGROUPS
                                          for p in program.programs for ins in p)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=4 << 20)
    parser.add_argument("--subgroup-size", type=int, default=256 << 10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--simulate", action="store_true",
                        help="simulate the 10b preset on paper-v100 instead (see above)")
    args = parser.parse_args()
    if args.simulate:
        print(json.dumps(simulated_10b(), indent=None if args.json else 2))
        return
    n, size = args.params, args.subgroup_size
    device = get_device()
    threads = args.threads or len(os.sched_getaffinity(0))
    rates = measure_update_rates(device, threads)
    model = gpu_update_stride(rates)
    k = model.k if model.k >= 2 else 2  # 0 (all CPU) on this machine: still check k = 2
    # k from Eq. 1 and its neighbours, and k = 2 so that the device path always runs
    # (a k above the number of subgroups puts none on the device)
    strides = sorted({max(2, k - 1), k, k + 1, 2})
    slot_bytes = DeviceSubgroupUpdater.bytes_needed(size)
    fraction = min(1.0, slot_bytes / (16.0 * n))  # p, m, v and the gradient resident

    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    variants = {}
    on_device: dict[str, int] = {}

    def variant(name: str, updater=None, plan=None) -> None:
        adam = CPUAdamW([init], lr=1e-4, threads=threads)
        if plan is not None:
            adam.set_subgroups(0, plan, updater)
        out = torch.empty(n, dtype=torch.bfloat16)
        variants[name] = (adam, out, updater)
        on_device[name] = sum(s.on_device for s in plan) if plan is not None else 0

    variant("cpu")
    variant("twinflow", ResidentSubgroupUpdater(device), plan_resident(n, size, fraction))
    for stride in strides:
        variant(f"interleaved_k{stride}", DeviceSubgroupUpdater(device, size),
                plan_subgroups(n, size, stride))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):
        for name, (adam, out, _) in variants.items():
            start = time.perf_counter()
            adam.step_group(0, grad, out=out)
            elapsed = time.perf_counter() - start
            adam.commit_group(0)
            if round_ > 0:  # the first round warms up
                times[name].append(elapsed)
    result = {
        "benchmark": "optimizer_subgroups",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, device "
                   f"{device.kind}",
        "params": n, "subgroup_size": size, "threads": threads, "rounds": args.rounds,
        "rates_params_per_s": rates.__dict__,
        "eq1": {"k": model.k, "k_real": model.k_real},
        "twinflow_fraction": fraction,
        "device_bytes": {name: (u.nbytes if u is not None else 0)
                         for name, (_, _, u) in variants.items()},
        "variants": {},
    }
    cpu_median = statistics.median(times["cpu"])
    for name, samples in times.items():
        median = statistics.median(samples)
        result["variants"][name] = {
            "median_s": median, "min_s": min(samples), "max_s": max(samples),
            "params_per_s": n / median, "speedup_vs_cpu": cpu_median / median,
            "device_subgroups": on_device[name],
        }
    device.close()
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
