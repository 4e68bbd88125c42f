#!/usr/bin/env python3
"""Print the GPU update stride k of Eq. 1 (Deep Optimizer States) for given throughputs:
every k-th optimizer subgroup is updated on the device, the others on the CPU; and the
placement `--optimizer-gpu-stride auto` takes (where Eq. 1 gives k < 1, the GPU-heavy
device:N, N-1 of every N subgroups on the device, when the timing model predicts it faster).

Example (the paper's 4x V100 machine: k = 2):
  tools/optimizer_stride.py --h2d-params-per-s 3e9 --gpu-update-params-per-s 35e9 \\
      --cpu-update-params-per-s 2e9 --downscale-params-per-s 8.7e9 [--json]

Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.schedules.optimizer_stride import UpdateRates, auto_split, split_flag  # noqa: E402

FLAGS = (("--h2d-params-per-s", "B: fp32 parameters per second over each host-device direction"),
         ("--gpu-update-params-per-s", "Ug: device AdamW update rate"),
         ("--cpu-update-params-per-s", "Uc: CPU AdamW update rate"),
         ("--downscale-params-per-s", "Dc: fp32 -> 16-bit conversion rate on the CPU"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, text in FLAGS:
        parser.add_argument(flag, type=float, required=True, help=text)
    parser.add_argument("--json", action="store_true",
                        help="one JSON object: k, the terms, the device's share of subgroups "
                             "and the placement chosen with its predicted times")
    args = parser.parse_args(argv)
    try:
        rates = UpdateRates(args.h2d_params_per_s, args.gpu_update_params_per_s,
                            args.cpu_update_params_per_s, args.downscale_params_per_s)
    except ValueError as error:
        flag = "--" + str(error).split("=", 1)[0].replace("_", "-")
        parser.exit(2, f"{parser.prog}: error: {flag}: {str(error).split('=', 1)[1]}\n")
    choice = auto_split(rates)
    model = choice.model
    if args.json:
        # device_share: Eq. 1's balance; device_share_at_k: what the stride k places (1 in k);
        # placement: what auto takes, its share and every candidate's predicted seconds
        print(json.dumps({**model.as_dict(), "k_real": model.k_real if model.k else None,
                          "device_share": model.device_share,
                          "device_share_at_k": 1.0 / model.k if model.k else 0.0,
                          "placement": choice.as_dict()}))
    elif model.k:
        predicted = ", ".join(f"{split_flag(s)} {t:.3g} s" for s, t in choice.predicted_s.items())
        print(f"k = {model.k} (Eq. 1 gives {model.k_real:.3f}): every {model.k}-th subgroup "
              f"on the device ({1 / model.k:.0%} of them; the balance puts "
              f"{model.device_share:.0%} there)\n"
              f"auto: --optimizer-gpu-stride {split_flag(choice.split)} "
              f"(predicted per 1e9 parameters: {predicted})")
    else:
        print("k = 0: the CPU update is not slower than sending its 16-bit copy; "
              "keep every subgroup on the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
