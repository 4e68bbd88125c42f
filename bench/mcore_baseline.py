"""megatron-core training the same LLaMA all on one device: the baseline of the decoupled run.

    python bench/mcore_baseline.py --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5504 \
        --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 --global-batch-size 16 \
        [--vocab-size 32000] [--iters 6] [--recompute none,full] [--dtype bf16] [--device auto]

megatron-core's GPTModel built from the project's TransformerConfig and layer spec
(megatron/models/llama.py: so core attention is the project's SDPAttention, which pins the
kernel megatron.config.attention_kernel's rule picks, as in the decoupled run: causal
attention without a mask tensor, flash or cuDNN in bf16), every
model state on the device: bf16 weights, fp32 master weights with fp32 gradients
accumulated over the micro-batches (as Megatron's DDP main_grad), torch's fused AdamW on
the masters, global-norm clipping. Random tokens. Each --recompute variant ("none", "full":
megatron-core's full recompute of every layer) is warmed up by one iteration, then the
variants alternate iteration by iteration on the same model, so drift hits them alike.
Prints one JSON object: per variant the iteration times (median and range), peak device
memory, model TFLOP/s and MFU against the GPU's datasheet peak (megatron/schedules/gpu_peaks.py),
and `attention_kernel`: the kernel core attention ran ("flash", "efficient", "cudnn", "math";
"unfused" for megatron-core's DotProductAttention), as the training metrics name it.
Runs on the CPU too (tiny sizes, for the test that it works).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.spread import spread  # noqa: E402
from megatron.config.model import ModelConfig  # noqa: E402
from megatron.models.attention import forget_kernels_run, kernels_run  # noqa: E402
from megatron.models.llama import (  # noqa: E402
    LlamaConfig,
    layer_implementation,
    layer_spec,
    transformer_config,
    uses_weight_decay,
)
from megatron.schedules.cost_model import megatron_model_flops_per_token  # noqa: E402
from megatron.schedules.gpu_peaks import datasheet_peak_flops  # noqa: E402
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RECOMPUTE = ("none", "full")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--num-query-groups", type=int, default=None,
                   help="default: the attention heads")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="padded to a multiple of 128 as Megatron pads it")
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--iters", type=int, default=6, help="timed iterations per variant")
    p.add_argument("--recompute", default=None,
                   help="comma-separated variants: none, full (default: both on CUDA, none "
                        "on the CPU)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="working weights")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    variants = (args.recompute or ("none,full" if args.device == "cuda" else "none")).split(",")
    if any(v not in RECOMPUTE for v in variants):
        p.error(f"--recompute {args.recompute}: expected a comma-separated list of "
                f"{', '.join(RECOMPUTE)}")
    if "full" in variants and args.device == "cpu":
        # tensor_parallel.checkpoint saves and restores the CUDA RNG states
        p.error("--recompute full: megatron-core's full recompute needs CUDA (it saves the "
                "CUDA RNG states); expected none on the CPU")
    if args.global_batch_size % args.micro_batch_size:
        p.error(f"--global-batch-size {args.global_batch_size}: expected a multiple of "
                f"--micro-batch-size ({args.micro_batch_size})")
    if args.iters < 1:
        p.error(f"--iters {args.iters}: expected at least 1")
    args.variants = variants
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        name="custom", num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups or args.num_attention_heads,
        seq_length=args.seq_length, vocab_size=args.vocab_size)


def start_megatron_core(device: str, seed: int) -> None:
    """The process start every model of this project goes through (the one device
    decision: set_device, the process group, megatron-core's RNG tracker seeded from
    `seed` as Megatron-LM does), so the baseline runs where and as our model runs."""
    choice = initialize_distributed(seed=seed).device
    if choice.kind != device:
        raise SystemExit(f"mcore_baseline.py: error: --device {device}: this process was "
                         f"placed on {choice.torch_device} (hide the GPUs with "
                         "CUDA_VISIBLE_DEVICES= for the CPU)")
    torch.manual_seed(seed)


def build_model(args: argparse.Namespace, shape: ModelConfig):
    """GPTModel with the project's TransformerConfig and layer spec, on the device."""
    from dataclasses import replace

    from megatron.core.models.gpt import GPTModel

    cfg = LlamaConfig.from_model(shape, shape.planned_vocab_size, args.seed).with_dtype(
        DTYPES[args.dtype])
    # Initialize on the device on CUDA (seconds instead of a minute on the host).
    config = replace(transformer_config(cfg), use_cpu_initialization=args.device == "cpu")
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(),
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                     position_embedding_type="rope", rotary_percent=cfg.rotary_percent,
                     rotary_base=int(cfg.rope_base),
                     share_embeddings_and_output_weights=False)
    return model.to(args.device), config


class MixedPrecisionAdamW:
    """fp32 masters of the working weights, their gradients accumulated in fp32 as each
    micro-batch's backward produces them (the working weight's gradient is then freed),
    torch's fused AdamW on the masters, the result copied back to the working weights."""

    def __init__(self, model: torch.nn.Module, lr: float, clip_grad: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        for param, master in zip(self.params, self.masters):
            master.grad = torch.zeros_like(master)
            param.register_post_accumulate_grad_hook(self._accumulator(master))
        names = {id(p): n for n, p in model.named_parameters()}
        decay = [uses_weight_decay(names[id(p)], p) for p in self.params]
        groups = [{"params": [m for m, d in zip(self.masters, decay) if d]},
                  {"params": [m for m, d in zip(self.masters, decay) if not d],
                   "weight_decay": 0.0}]
        # LLaMA-2's recipe (the presets' betas and weight decay).
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=0.1, fused=True)
        self.clip_grad = clip_grad

    @staticmethod
    def _accumulator(master: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            master.grad.add_(param.grad)
            param.grad = None
        return accumulate

    def step(self) -> None:
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip_grad, foreach=True)
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.masters)
        torch._foreach_zero_([m.grad for m in self.masters])


def random_batches(args: argparse.Namespace, vocab: int, count: int) -> list[dict]:
    """`count` micro-batches of random tokens and positions. No mask tensor: causal
    attention as the decoupled run computes it (is_causal; a mask would rule flash out)."""
    generator = torch.Generator().manual_seed(args.seed)
    s, b = args.seq_length, args.micro_batch_size
    positions = torch.arange(s).unsqueeze(0).expand(b, s).to(args.device)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (b, s + 1), generator=generator).to(args.device)
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "position_ids": positions,
                        "attention_mask": None, "labels": tokens[:, 1:].contiguous()})
    return batches


def set_recompute(config, variant: str) -> None:
    """megatron-core reads these at every forward (TransformerBlock.forward)."""
    full = variant == "full"
    config.recompute_granularity = "full" if full else None
    config.recompute_method = "uniform" if full else None
    config.recompute_num_layers = 1 if full else None


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_iteration(model, optimizer: MixedPrecisionAdamW, batches: list[dict]) -> float:
    """One global batch: every micro-batch's forward and backward, then the step."""
    losses = []
    for batch in batches:
        loss = model(**batch).float().mean() / len(batches)
        loss.backward()
        losses.append(loss.detach())
    optimizer.step()
    return float(torch.stack(losses).sum())  # the iteration's one host sync


def measure(args: argparse.Namespace) -> dict:
    shape = model_config(args)
    start_megatron_core(args.device, args.seed)
    model, config = build_model(args, shape)
    forget_kernels_run()
    optimizer = MixedPrecisionAdamW(model, args.lr, args.clip_grad)
    batches = random_batches(args, shape.planned_vocab_size,
                             args.global_batch_size // args.micro_batch_size)
    tokens = args.global_batch_size * args.seq_length
    flops = megatron_model_flops_per_token(shape) * tokens
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = datasheet_peak_flops(name, args.dtype) if args.dtype != "fp32" else None
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    memory: dict[str, int] = dict.fromkeys(args.variants, 0)
    losses: dict[str, list[float]] = {v: [] for v in args.variants}
    for round_index in range(args.iters + 1):  # round 0: the warm-up of every variant
        for variant in args.variants:
            set_recompute(config, variant)
            synchronize(args.device)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            loss = train_iteration(model, optimizer, batches)
            synchronize(args.device)
            elapsed = time.perf_counter() - started
            if args.device == "cuda":
                memory[variant] = max(memory[variant], torch.cuda.max_memory_allocated())
            losses[variant].append(loss)
            if round_index > 0:
                times[variant].append(elapsed)
    variants = {}
    for variant in args.variants:
        median = spread(times[variant])["median"]
        variants[variant] = {
            "iteration_s": spread(times[variant]), "iteration_times_s": times[variant],
            "device_memory_peak_bytes": memory[variant] if args.device == "cuda" else None,
            "tokens_per_s": tokens / median, "model_tflops": flops / median / 1e12,
            "mfu": flops / median / peak if peak else None, "losses": losses[variant]}
    return {"benchmark": "mcore_baseline", "device": args.device, "device_name": name,
            "torch": torch.__version__, "dtype": args.dtype,
            "attention_kernel": kernels_run(implementation=layer_implementation()),
            "model": {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                      "ffn_hidden_size": shape.ffn_hidden_size,
                      "num_attention_heads": shape.num_attention_heads,
                      "num_query_groups": shape.num_query_groups,
                      "seq_length": shape.seq_length, "vocab_size": shape.planned_vocab_size,
                      "parameters": shape.parameters().total},
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size, "timed_iterations": args.iters,
            "model_flops_per_iteration": flops, "datasheet_peak_flops": peak,
            "variants": variants}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_here = not dist.is_initialized()  # a caller's process group stays its own
    try:
        result = measure(args)
    finally:
        if started_here:
            shutdown_distributed()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
