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

from megatron.config.errors import ConfigError  # noqa: E402
from megatron.config.run import RunConfig  # noqa: E402
from megatron.data.demo_corpus import ensure_demo_corpus  # noqa: E402
from megatron.data.tokenizer import load_tokenizer  # noqa: E402
from megatron.planning.evaluate import (  # noqa: E402
    base_configuration,
    configured,
    evaluate,
    plan_hardware,
)
from megatron.planning.search import search  # noqa: E402
from megatron.training.arguments import exit_bad_input, parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.training import train  # noqa: E402


def candidates(run: RunConfig, world: int) -> list[dict]:
    """The search's top five and the default configuration, with their predictions."""
    hardware = plan_hardware(run)
    run = run.evolve(planning={"gpus_per_node": world, "nodes": 1})
    found = search(run, hardware).ranked
    rows = [dict(e.summary(), label=f"candidate {i + 1}", config=e.config)
            for i, e in enumerate(found[:5])]
    default = evaluate(run, base_configuration(run), hardware)
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
    run = parse_args(rest)
    quiet = {"log_interval": max(run.logging.log_interval, run.training.train_iters)}
    run = run.evolve(logging=quiet)
    if run.model.vocab_size is None and run.data.data_path is None:  # the real model's size
        corpus = ensure_demo_corpus(cache_dir=run.data.data_cache_dir, log=lambda *_: None)
        run = run.evolve(model={"vocab_size": load_tokenizer(corpus.tokenizer_path).vocab_size})
    dist_info = initialize_distributed()
    try:
        rows = candidates(run, dist_info.world_size)
        for row in rows:
            row["measured_s"] = []
        for _ in range(bench.rounds):
            for row in rows:
                measured = configured(run, row["config"]).evolve(
                    logging={"metrics_file": None}, checkpointing={"save": None})
                with contextlib.redirect_stdout(sys.stderr):
                    records = train(measured, dist_info)
                row["measured_s"].append(statistics.median(
                    r["iter_time_s"] for r in (records[1:] or records)))
    except ConfigError as exc:
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
    summary = {"model": run.model.name, "ranks": dist_info.world_size,
               "hardware": run.planning.hardware, "rounds": bench.rounds,
               "iterations_per_run": run.training.train_iters, "configurations": rows,
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
