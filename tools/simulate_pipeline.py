#!/usr/bin/env python3
"""Simulate one training iteration of a pipeline schedule and report its bubbles.

Examples:
  tools/simulate_pipeline.py --schedule decoupled --ranks 4 --forward-stages 8 \\
      --backward-split 2 --micro-batches 4 --json --plot fig8.png --trace fig8.json
  tools/simulate_pipeline.py --schedule mobius --ranks 4 --forward-stages 8 \\
      --backward-split 1 --micro-batches 4 --optimizer-time 2 --param-transfer-time 0.5
  tools/simulate_pipeline.py --schedule decoupled --ranks 4 --forward-stages 8 \\
      --backward-split 2 --micro-batches 8 --model-preset 10b --hardware paper-v100 \\
      --micro-batch-size 2 --schedule-file my.csv       # writes my.csv; edit it, then:
  tools/simulate_pipeline.py --schedule-file my.csv --model-preset 10b --micro-batch-size 2

Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.common.files import make_parent_dir  # noqa: E402
from megatron.config.output_paths import check_writable_file  # noqa: E402
from megatron.schedules.cost_model import (  # noqa: E402
    derived_costs,
    model_partition,
    uniform_costs,
)
from megatron.schedules.distribution import DISTRIBUTION_MODES, simulate_distribution  # noqa: E402
from megatron.schedules.generators import (  # noqa: E402
    PAPER_BACKWARD_RATIO,
    RECOMPUTE_BACKWARD_RATIO,
    SCHEDULE_NAMES,
    build_schedule,
)
from megatron.schedules.hardware import HARDWARE_PROFILES  # noqa: E402
from megatron.schedules.interpreter import ScheduleError  # noqa: E402
from megatron.schedules.schedule_file import read_schedule, write_schedule  # noqa: E402
from megatron.schedules.simulator import simulate  # noqa: E402
from megatron.schedules.timeline import write_chrome_trace, write_timeline_png  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _non_negative(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a number") from None
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a number >= 0")
        return value
    return parse


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} {value}: expected an integer >= 1")
        return value
    return parse


def _partition(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--partition {text!r}: expected comma-separated layer counts, e.g. 3,3,2") from None
    return layers


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="simulate_pipeline.py",
        description="Simulate a pipeline schedule (SysX decoupled, Mobius, GPipe, 1F1B, "
                    "interleaved 1F1B) and report iteration time and bubble ratios.")
    shape = parser.add_argument_group("schedule")
    shape.add_argument("--schedule", choices=SCHEDULE_NAMES, help="schedule to generate")
    shape.add_argument("--ranks", type=_positive_int("--ranks"), help="GPUs (pipeline ranks)")
    shape.add_argument("--forward-stages", type=_positive_int("--forward-stages"))
    shape.add_argument("--backward-split", type=_positive_int("--backward-split"), default=1,
                       help="backward stages per forward stage (d); decoupled only")
    shape.add_argument("--micro-batches", type=int, help="micro-batches per iteration")
    shape.add_argument("--partition", type=_partition,
                       help="decoder layers per forward stage, e.g. 7,6,6,7 (default: even)")
    shape.add_argument("--num-layers", type=_positive_int("--num-layers"),
                       help="decoder layers to balance over the stages (abstract costs)")
    shape.add_argument("--schedule-file", metavar="FILE.csv",
                       help="with --schedule: write the generated schedule there; without: "
                            "read the schedule to simulate from it")
    costs = parser.add_argument_group("abstract costs (per forward stage; a backward stage "
                                      "of a stage split d ways costs 1/d)")
    for flag, default, text in (
        ("--forward-time", 1.0, "forward per micro-batch"),
        ("--backward-time", 2.0, "backward per micro-batch (without recompute)"),
        ("--recompute-time", 0.0, "recompute before the backward, per micro-batch"),
        ("--optimizer-time", 0.0, "CPU optimizer step"),
        ("--param-transfer-time", 0.0, "host-to-device parameter copy"),
        ("--grad-transfer-time", 0.0, "device-to-host gradient copy"),
        ("--p2p-time", 0.0, "one activation/gradient/checkpoint between ranks"),
        ("--inter-node-time", 0.0, "a forward stage's parameters from one node to another"),
    ):
        costs.add_argument(flag, type=_non_negative(flag), default=default, help=text)
    derived = parser.add_argument_group("derived costs (replace the abstract ones)")
    derived.add_argument("--model-preset", help="model preset, e.g. 10b (S Table 2)")
    derived.add_argument("--hardware", default="paper-v100", choices=list(HARDWARE_PROFILES))
    derived.add_argument("--micro-batch-size", type=_positive_int("--micro-batch-size"), default=2)
    derived.add_argument("--seq-length", type=_positive_int("--seq-length"))
    nodes = parser.add_argument_group("nodes")
    nodes.add_argument("--procs-per-node", type=_positive_int("--procs-per-node"),
                       help="ranks per node (default: all on one node); with several nodes, "
                            "also simulates moving the parameters between them after the "
                            "step, blocking and per stage")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--plot", metavar="FILE.png", help="write a timeline picture")
    out.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace")
    return parser


def _schedule(args: argparse.Namespace, parser: argparse.ArgumentParser):
    if args.schedule_file and not args.schedule:
        return read_schedule(args.schedule_file)
    if not args.schedule:
        parser.error("--schedule or --schedule-file is required")
    for flag in ("ranks", "forward_stages", "micro_batches"):
        if getattr(args, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required with --schedule")
    if args.micro_batches < 1:
        parser.error(f"--micro-batches {args.micro_batches}: expected an integer >= 1")
    partition = args.partition
    if partition is None and args.model_preset:
        partition = model_partition(args.model_preset, args.forward_stages, args.seq_length)
    elif partition is None and args.num_layers:
        from megatron.schedules.partition import balanced_partition

        partition = balanced_partition(args.num_layers, args.forward_stages)
    # Place blocking transfers for the costs that will be simulated (derived: backward 2x
    # plus a full recompute).
    ratio = (RECOMPUTE_BACKWARD_RATIO if args.model_preset
             else (args.backward_time + args.recompute_time) / args.forward_time)
    return build_schedule(args.schedule, args.ranks, args.forward_stages, args.backward_split,
                          args.micro_batches, partition,
                          backward_ratio=ratio or PAPER_BACKWARD_RATIO)


def _check_outputs(args: argparse.Namespace) -> None:
    """ConfigError for a file this run would write and cannot (before it simulates)."""
    outputs = {"--plot": args.plot, "--trace": args.trace,
               "--schedule-file": args.schedule_file if args.schedule else None}
    for flag, path in outputs.items():
        if path:
            check_writable_file(flag, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        schedule = _schedule(args, parser)
        if args.model_preset:
            costs = derived_costs(schedule, args.model_preset, args.hardware,
                                  args.micro_batch_size, args.seq_length)
        else:
            costs = uniform_costs(
                schedule, args.forward_time, args.backward_time, args.recompute_time,
                args.optimizer_time, args.param_transfer_time, args.grad_transfer_time,
                args.p2p_time, args.inter_node_time)
        result = simulate(schedule, costs)
        distribution = []
        if args.procs_per_node and args.procs_per_node < schedule.ranks:
            distribution = [simulate_distribution(schedule, costs, args.procs_per_node, mode)
                            for mode in DISTRIBUTION_MODES]
    except (ValueError, KeyError, ScheduleError) as error:
        message = error.args[0] if isinstance(error, KeyError) else str(error)
        parser.error(message)
    if args.schedule_file and args.schedule:
        make_parent_dir(args.schedule_file)  # checked writable at the start
        write_schedule(schedule, args.schedule_file)
    if args.plot:
        title = (f"{schedule.name}: {schedule.ranks} ranks, {schedule.forward_stages} forward "
                 f"stages, d={schedule.backward_split}, {schedule.micro_batches} micro-batches; "
                 f"bubble {result.mean_bubble_ratio:.1%}")
        make_parent_dir(args.plot)
        write_timeline_png(result.events, args.plot, title=title,
                           time_unit="s" if args.model_preset
                           else "cost-model units: one stage's forward = 1")
    if args.trace:
        make_parent_dir(args.trace)
        write_chrome_trace(result.events, args.trace,
                           time_scale=1e6 if args.model_preset else 1e3)
    summary = result.summary()
    if distribution:
        summary["parameter_distribution"] = [d.summary() for d in distribution]
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{schedule.name}: iteration time {result.iteration_time:.4g}, mean bubble ratio "
              f"{result.mean_bubble_ratio:.1%}, exposed optimizer time "
              f"{result.exposed_optimizer_time:.4g}")
        for row in summary["per_rank"]:
            print(f"  rank {row['rank']}: busy {row['busy']:.4g}, bubble {row['bubble_ratio']:.1%}, "
                  f"peak params {row['peak_params']} backward stages, peak checkpoints "
                  f"{row['peak_checkpoints']}")
        for d in distribution:
            print(f"  parameters to other nodes, {d.mode}: exposed {d.exposed_time:.4g} "
                  f"({len(d.transfers)} pushes, {d.link_time:.4g} on the links)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
