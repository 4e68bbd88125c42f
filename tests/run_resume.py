"""Test harness: an uninterrupted run and its resume from a middle checkpoint, in one job
(the start-up is paid once).

    torchrun --nproc-per-node N tests/run_resume.py --out-dir DIR --resume-at K \
        [pretrain_llama.py flags]

DIR/straight/: the uninterrupted run (metrics, a checkpoint every K iterations).
DIR/resumed/: the same flags loaded from a copy of the straight run's iteration-K
checkpoint alone (as if the run had died after it), trained to the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.checkpointing import TRACKER, iteration_dir  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.training import train  # noqa: E402


def outputs(run, out: str, **checkpointing):
    return run.evolve(logging={"metrics_file": os.path.join(out, "metrics.jsonl")},
                      checkpointing={"save": os.path.join(out, "ckpt"), **checkpointing})


def main() -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out-dir", required=True)
    own.add_argument("--resume-at", type=int, required=True)
    harness, rest = own.parse_known_args()
    straight = os.path.join(harness.out_dir, "straight")
    base = parse_args([*rest, "--save", os.path.join(straight, "ckpt"),
                       "--save-interval", str(harness.resume_at)])
    dist_info = initialize_distributed(data_parallel_size=base.data_parallel_size)
    try:
        train(outputs(base, straight), dist_info)
        saved = os.path.join(harness.out_dir, "saved")
        if dist_info.rank == 0:
            name = os.path.basename(iteration_dir(saved, harness.resume_at))
            shutil.copytree(iteration_dir(os.path.join(straight, "ckpt"), harness.resume_at),
                            os.path.join(saved, name))
            with open(os.path.join(saved, TRACKER), "w") as f:
                f.write(str(harness.resume_at))
        dist.barrier()
        train(outputs(base, os.path.join(harness.out_dir, "resumed"), load=saved), dist_info)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
