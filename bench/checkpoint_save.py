"""Benchmark of the time a checkpoint save blocks training: asynchronous against synchronous.

    python bench/checkpoint_save.py [--params N] [--rounds R] [--dir DIR] [--json]

One process saves the model states of N parameters (fp32 master, Adam m and v: 12 bytes a
parameter, in 2 tensors per 4M parameters like a model's layers) R times with each variant,
interleaved round by round, and reports median, min and max seconds:
- async_blocked_s: what `CheckpointSaver(async_save=True).save()` blocks (waiting for the
  previous save, free-disk check, the host-memory snapshot into buffers allocated at the
  first save: round 1 pays the allocation, later rounds only the copy); the write runs
  in a thread.
- async_total_s: from that call until the background write has committed.
- sync_blocked_s: `CheckpointSaver(async_save=False).save()`: the whole write blocks.
- torch_save_s: one `torch.save` of the same tensors into one file (the per-rank format
  of before, for scale).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spread import spread  # noqa: E402
from megatron.models.llama import LlamaConfig  # noqa: E402
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, OwnedState  # noqa: E402
from megatron.training.checkpointing import CheckpointSaver, iteration_dir  # noqa: E402
from megatron.training.distributed import (  # noqa: E402
    initialize_distributed,
    shutdown_distributed,
)


def make_state(params: int) -> tuple[LlamaConfig, OwnedState]:
    """A LLaMA of about `params` parameters (hidden 512): its masters and moments."""
    h, f, vocab = 512, 1536, 8192
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    cfg = LlamaConfig(num_layers=max(1, (params - 2 * vocab * h) // per_layer), hidden_size=h,
                      ffn_hidden_size=f, num_attention_heads=8, num_query_groups=8,
                      vocab_size=vocab, seq_length=128)
    shapes = {"embedding.word_embeddings.weight": (vocab, h), "output_layer.weight": (vocab, h),
              "decoder.final_layernorm.weight": (h,)}
    for i in range(cfg.num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in {
            "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
            "self_attention.linear_qkv.weight": (3 * h, h),
            "self_attention.linear_proj.weight": (h, h),
            "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}.items()})
    tensors = {prefix + name: torch.randn(shape) for name, shape in shapes.items()
               for prefix in (MASTER, EXP_AVG, EXP_AVG_SQ)}
    return cfg, OwnedState(tensors, optimizer_step=1, loss_scaler=None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=25_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    initialize_distributed()  # megatron-core's sharded layout needs its process groups
    cfg, state = make_state(args.params)
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("async_blocked_s", "async_total_s", "sync_blocked_s",
                                      "torch_save_s")}
    quiet = open(os.devnull, "w")
    savers = {mode: CheckpointSaver(os.path.join(root, mode), cfg, async_save=mode == "async",
                                    log=lambda *_: None) for mode in ("async", "sync")}
    try:
        for r in range(1, args.rounds + 1):
            for mode, saver in savers.items():
                stdout, sys.stdout = sys.stdout, quiet  # the per-shard progress lines
                try:
                    t0 = time.perf_counter()
                    blocked = saver.save(r, state, {})
                    saver.wait()
                    total = time.perf_counter() - t0
                finally:
                    sys.stdout = stdout
                times[f"{mode}_blocked_s"].append(blocked)
                if mode == "async":
                    times["async_total_s"].append(total)
                shutil.rmtree(iteration_dir(saver.root, r))
            t0 = time.perf_counter()
            torch.save(state.tensors, os.path.join(root, "whole.pt"))
            times["torch_save_s"].append(time.perf_counter() - t0)
            os.unlink(os.path.join(root, "whole.pt"))
    finally:
        for saver in savers.values():
            saver.close()
        shutil.rmtree(root, ignore_errors=True)
        shutdown_distributed()
    result = {
        "bench": "checkpoint_save", "params": args.params,
        "bytes": state.nbytes, "rounds": args.rounds,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        **{k: spread(v) for k, v in times.items()},
    }
    result["sync_over_async_blocked"] = (result["sync_blocked_s"]["median"]
                                         / result["async_blocked_s"]["median"])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
