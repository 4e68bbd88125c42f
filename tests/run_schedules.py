"""Test harness: several schedules in one torchrun job, so the suite pays the start-up once.

    torchrun --nproc-per-node N tests/run_schedules.py --out-dir DIR --schedules a,b \
        [--zero-stages 1,2] [pretrain_llama.py flags]

Each schedule trains from the same initial weights through the library's `train()`; its
metrics, final checkpoint and the last iteration's trace go to DIR/<schedule>/.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.planning.shape import with_schedule  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.training import train  # noqa: E402


def main() -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out-dir", required=True)
    own.add_argument("--schedules", required=True)
    own.add_argument("--zero-stages", default=None,
                     help="run each schedule once per ZeRO stage (DIR/<schedule>-zero<N>/)")
    harness, rest = own.parse_known_args()
    base = parse_args(rest)
    dist_info = initialize_distributed(data_parallel_size=base.data_parallel_size)
    try:
        stages = harness.zero_stages.split(",") if harness.zero_stages else [None]
        runs = [(name, zero) for name in harness.schedules.split(",") for zero in stages]
        for name, zero in runs:
            run = with_schedule(base, name)
            out = os.path.join(harness.out_dir, name)
            if zero is not None:
                run = run.evolve(parallel={"zero_stage": int(zero)})
                out = f"{out}-zero{zero}"
            train(run.evolve(logging={"metrics_file": os.path.join(out, "metrics.jsonl"),
                                      "trace": os.path.join(out, "trace.json"),
                                      "tensorboard_dir": os.path.join(out, "tb"),
                                      "log_timers_to_tensorboard": True},
                             checkpointing={"save": os.path.join(out, "ckpt")}), dist_info)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
