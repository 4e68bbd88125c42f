"""How far a bf16 sum of the micro-batches' gradients drifts from the exact sum, beside the
fp32 sum Megatron-LM's main gradients (and this runtime's, by default) hold.

    python bench/grad_sum_precision.py --json [--model-preset tiny] [--micro-batches 4,16,64]
        [--micro-batch-size 2] [--seed 0]

The preset's LLaMA in bf16 (one process, the whole model), each micro-batch random tokens,
each micro-batch's loss divided by the number of micro-batches as a training iteration
divides it; every micro-batch's bf16 gradients (autograd's) summed three ways: in bf16
(`--grad-reduce-in-bf16`: each addition rounds to bf16), in fp32 (the default), and in
float64, the reference. Reported per count of micro-batches: ||sum - exact|| / ||exact||
over all parameters, and the same for the gradient norm alone (what clipping and the
logged grad norm see). Numerics, not speed: one draw per count, deterministic per --seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.config.presets import get_preset  # noqa: E402
from megatron.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402

VOCAB = 4096


def micro_batch(cfg: LlamaConfig, size: int, generator: torch.Generator) -> dict:
    s = cfg.seq_length
    return {"tokens": torch.randint(0, cfg.vocab_size, (size, s), generator=generator),
            "labels": torch.randint(0, cfg.vocab_size, (size, s), generator=generator),
            "loss_mask": torch.ones(size, s), "position_ids": torch.arange(s).expand(size, s)}


def drift(preset: str, counts: list[int], size: int, seed: int) -> list[dict]:
    cfg = LlamaConfig.from_model(get_preset(preset), VOCAB, seed)
    model = LlamaModel(cfg.with_dtype(torch.float32)).to(torch.bfloat16)
    params = list(model.parameters())
    rows = []
    for count in counts:
        generator = torch.Generator().manual_seed(seed + count)
        sums = {dtype: [torch.zeros_like(p, dtype=dtype) for p in params]
                for dtype in (torch.bfloat16, torch.float32, torch.float64)}
        for _ in range(count):
            for p in params:
                p.grad = None
            (model(micro_batch(cfg, size, generator)) / count).backward()
            for dtype, total in sums.items():
                for t, p in zip(total, params):
                    t.add_(p.grad.to(dtype) if dtype == torch.bfloat16 else p.grad)
        exact = torch.cat([t.reshape(-1) for t in sums[torch.float64]])
        row = {"micro_batches": count}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            got = torch.cat([t.reshape(-1).double() for t in sums[dtype]])
            row[f"{name}_sum_error_over_norm"] = float((got - exact).norm() / exact.norm())
            row[f"{name}_grad_norm_error"] = float(abs(got.norm() - exact.norm()) / exact.norm())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-preset", default="tiny")
    p.add_argument("--micro-batches", default="4,16,64")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    counts = [int(c) for c in a.micro_batches.split(",")]
    initialize_distributed()  # megatron-core's layers need their process groups
    try:
        rows = drift(a.model_preset, counts, a.micro_batch_size, a.seed)
    finally:
        shutdown_distributed()
    out = {"model": a.model_preset, "micro_batch_size": a.micro_batch_size, "seed": a.seed,
           "vocab_size": VOCAB, "rows": rows}
    if a.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(f"{r['micro_batches']:>4} micro-batches: bf16 sum off by "
                  f"{r['bf16_sum_error_over_norm']:.2e} of the norm (fp32: "
                  f"{r['fp32_sum_error_over_norm']:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
