"""Training quality with 16-bit optimizer states: the tiny preset on the built-in corpus,
fp32 states against bf16 m, v and master with stochastic rounding and with rounding to
nearest; one process running the one-rank decoupled pipeline (the CPU optimizer).

    python bench/optimizer_precision_quality.py --out-dir DIR [--iters 300] [--reuse]
        [--plot docs/img/optimizer_precision_loss.png]

Each variant writes DIR/<variant>.jsonl (the metrics file); --reuse skips a variant
whose metrics file already holds --iters iterations. Prints one JSON object: per variant
the final loss (mean of the last 20 iterations) and its ratio to the fp32 run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "fp32": [],
    "bf16_sr": ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"],
    "bf16_nearest": ["--optimizer-state-dtype", "bf16", "--master-dtype", "bf16",
                     "--master-rounding", "nearest"],
}
LABELS = {"fp32": "fp32 master, m, v (12 B/param)",
          "bf16_sr": "bf16 master, m, v, stochastic rounding (6 B/param)",
          "bf16_nearest": "bf16 master, m, v, round to nearest (6 B/param)"}
TAIL = 20


def losses(path: str) -> list[float]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "evaluation" not in r]


def train(variant: str, out_dir: str, iters: int, cache_dir: str | None) -> str:
    path = os.path.join(out_dir, f"{variant}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_llama.py"), "--model-preset", "tiny",
           "--train-iters", str(iters), "--log-interval", "50", "--eval-iters", "0",
           "--pipeline-schedule", "decoupled", "--metrics-file", path, *VARIANTS[variant]]
    if cache_dir:
        cmd += ["--data-cache-dir", cache_dir]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    base = curves["fp32"]
    for variant, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=LABELS[variant], linewidth=1)
        # the difference to fp32, averaged over 20 iterations (the batches are the same)
        d = [y - b for y, b in zip(ys, base)]
        smooth = [sum(d[max(0, i - TAIL + 1):i + 1]) / len(d[max(0, i - TAIL + 1):i + 1])
                  for i in range(len(d))]
        diff.plot(range(1, len(d) + 1), smooth, linewidth=1)
    ax.set_ylabel("training loss")
    ax.set_title("tiny preset, built-in corpus: optimizer state precision")
    ax.legend()
    diff.set_xlabel("iteration")
    diff.set_ylabel(f"loss - fp32 loss\n(mean of {TAIL})")
    diff.axhline(0.0, color="black", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--data-cache-dir", default=None)
    parser.add_argument("--plot", default=None, metavar="FILE.png")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    curves = {}
    for variant in VARIANTS:
        path = os.path.join(args.out_dir, f"{variant}.jsonl")
        if not (args.reuse and os.path.exists(path) and len(losses(path)) == args.iters):
            path = train(variant, args.out_dir, args.iters, args.data_cache_dir)
        curves[variant] = losses(path)
    final = {v: sum(ys[-TAIL:]) / TAIL for v, ys in curves.items()}
    result = {"iters": args.iters, "final_loss_mean_of_last": TAIL, "final_loss": final,
              "over_fp32": {v: final[v] / final["fp32"] for v in final}}
    if args.plot:
        plot(curves, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
