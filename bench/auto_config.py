"""--auto-config's choice against the configurations it compared, measured side by side.

    tools/profile_hardware.py --out hw.json
    torchrun --standalone --nproc-per-node 2 bench/auto_config.py --model-preset small \
        --hardware hw.json --train-iters 2 --rounds 2 --json

Every rank runs the same search (schedule, forward stages, backward split, micro-batch size
at the given global batch, on this profile) and takes its five fastest predictions, plus the
configuration the flags give without --auto-config (the default). Then, for --rounds rounds,
each configuration trains --train-iters iterations in turn from the same initial weights
(interleaved, so a disturbance of the shared machine spreads over all of them); the first
iteration of each run is a warm-up. Reported per configuration: the prediction, the median
measured iteration time over the rounds and its spread (min, max); and the chosen
configuration's median over the best median.

Rank 0 prints one JSON object (--json) or a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

from megatron.training.arguments import ArgumentError, exit_bad_input, parse_args  # noqa: E402
from megatron.training.demo_corpus import ensure_demo_corpus  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.plan import (  # noqa: E402
    base_configuration,
    evaluate,
    plan_hardware,
    search,
    simulated,
    with_configuration,
)
from megatron.training.tokenizer import load_tokenizer  # noqa: E402
from megatron.training.training import train  # noqa: E402


def candidates(args: argparse.Namespace, world: int) -> list[dict]:
    """The search's top five and the default configuration, with their predictions."""
    hardware = plan_hardware(args)
    args.gpus_per_node, args.nodes = world, 1
    found = search(args, hardware).ranked
    rows = [dict(e.summary(), label=f"candidate {i + 1}", config=e.config)
            for i, e in enumerate(found[:5])]
    default = simulated(args, evaluate(args, base_configuration(args), hardware, False), hardware)
    shape = ("schedule", "forward_stages", "backward_split", "micro_batch_size",
             "optimizer_gpu_stride")
    if all(any(r[k] != default.summary()[k] for k in shape) for r in rows):
        rows.append(dict(default.summary(), label="default", config=default.config))
    return rows


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--rounds", type=int, default=2)
    own.add_argument("--json", action="store_true")
    bench, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = parse_args(rest)
    args.log_interval = max(args.log_interval, args.train_iters)  # quiet
    if args.vocab_size is None and args.data_path is None:  # the search sizes the real model
        corpus = ensure_demo_corpus(cache_dir=args.data_cache_dir, log=lambda *_: None)
        args.vocab_size = load_tokenizer(corpus.tokenizer_path).vocab_size
    dist_info = initialize_distributed()
    try:
        rows = candidates(args, dist_info.world_size)
        for row in rows:
            row["measured_s"] = []
        for _ in range(bench.rounds):
            for row in rows:
                run = with_configuration(args, row["config"])
                run.metrics_file = run.save = None
                with contextlib.redirect_stdout(sys.stderr):
                    records = train(run, dist_info)
                row["measured_s"].append(statistics.median(
                    r["iter_time_s"] for r in (records[1:] or records)))
    except ArgumentError as exc:
        exit_bad_input(exc)
    finally:
        shutdown_distributed()
    if dist_info.rank != 0:
        return 0
    for row in rows:
        row.pop("config")
        row["median_s"] = statistics.median(row["measured_s"])
        row["spread_s"] = [min(row["measured_s"]), max(row["measured_s"])]
    best = min(row["median_s"] for row in rows[:5])
    summary = {"model": args.model_preset, "ranks": dist_info.world_size,
               "hardware": args.hardware, "rounds": bench.rounds,
               "iterations_per_run": args.train_iters, "configurations": rows,
               "chosen_over_best_measured": rows[0]["median_s"] / best}
    if bench.json:
        print(json.dumps(summary, indent=1))
    else:
        for row in rows:
            print(f"{row['label']:<12} {row['flags']:<80} predicted "
                  f"{row['predicted_iteration_s']:7.2f} s  measured {row['median_s']:7.2f} s "
                  f"[{row['spread_s'][0]:.2f}, {row['spread_s'][1]:.2f}]")
        print(f"chosen / best measured: {summary['chosen_over_best_measured']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
