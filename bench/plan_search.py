"""How long --auto-config's search takes: the bounded search against building every shape.

    python bench/plan_search.py [--model-preset 110b] [--nodes 8] [--seq-length 2048]
                                [--rounds 2] [--json]

Three ways to the same top five, interleaved over rounds (order rotated each round): the
search with its lower bounds on one worker, the same on every core, and every shape
built, checked and simulated on one worker (what the search did before it had bounds).
Prints one JSON object: per way the median, min and max seconds, and how many shapes
each built; `same_top5` says whether the three agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spread import spread  # noqa: E402
from megatron.common.workers import cores_per_rank  # noqa: E402
from megatron.config.run import RunConfig  # noqa: E402
from megatron.planning import search as plan  # noqa: E402
from megatron.planning.evaluate import plan_hardware  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402


def every_shape(run: RunConfig, hardware) -> tuple[list, int]:
    """Every shape built and simulated with every stride: the ranking and the count."""
    shares = plan.searched_updates(run, hardware)
    shapes = plan.searched_configurations(run, hardware)
    found = [e for config in shapes for e in plan.evaluate_shape((run, config, shares, hardware))]
    found.sort(key=plan.rank_key)
    return found, len(shapes) * len(shares)


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own.add_argument("--model-preset", default="110b")
    own.add_argument("--nodes", type=int, default=8)
    own.add_argument("--seq-length", type=int, default=2048)
    own.add_argument("--rounds", type=int, default=2)
    own.add_argument("--json", action="store_true")
    bench = own.parse_args(argv)
    run = parse_args(["--plan", "--auto-config", "--model-preset", bench.model_preset, "--bf16",
                       "--nodes", str(bench.nodes), "--gpus-per-node", "4",
                       "--micro-batch-size", "2", "--seq-length", str(bench.seq_length),
                       "--global-batch-size", str(16 * bench.nodes)])
    hardware = plan_hardware(run)
    cores = cores_per_rank()
    ways = {
        "bounded_1_worker": lambda: plan.search(run, hardware, workers=1),
        f"bounded_{cores}_workers": lambda: plan.search(run, hardware, workers=cores),
        "every_shape_1_worker": lambda: every_shape(run, hardware),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    tops, built = {}, {}
    names = list(ways)
    for round_ in range(bench.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            out = ways[name]()
            seconds[name].append(time.perf_counter() - start)
            ranked, count = (out.ranked, out.built) if hasattr(out, "ranked") else out
            tops[name] = [e.config.flags() for e in ranked[:plan.SEARCH_TOP]]
            built[name] = count
            if not bench.json:
                print(f"round {round_ + 1}: {name} {seconds[name][-1]:.1f} s", file=sys.stderr)
    result = {
        "model": bench.model_preset, "nodes": bench.nodes, "seq_length": bench.seq_length,
        "hardware": hardware.name, "rounds": bench.rounds, "cores": cores,
        "ways": {name: {"seconds": spread(seconds[name]), "configurations_built": built[name]}
                 for name in ways},
        "same_top5": len({tuple(t) for t in tops.values()}) == 1,
        "top5": tops[names[0]],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
