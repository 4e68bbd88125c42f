"""The training loop: data, model, optimizer step, LR schedule, logging, metrics, checkpoints.

The loop is the same for one process and for a pipeline: what differs is the `TrainStep`
that runs one iteration over its micro-batches. `LocalTrainStep` (this file) trains the whole
model in one process with torch's AdamW on fp32 master weights; it is also the reference the
pipeline executor is checked against.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron.models.llama import Batch, LlamaConfig, LlamaModel, uses_weight_decay
from megatron.optimizer.loss_scaler import DynamicLossScaler
from megatron.training.arguments import (
    ArgumentError,
    check_writable_dir,
    exit_bad_input,
    parse_args,
)
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron.training.lr_schedule import LRSchedule
from megatron.training.metrics import MetricsWriter, format_log_line


def training_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


@dataclass
class StepResult:
    loss: float
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None
    extra: dict = field(default_factory=dict)  # e.g. the pipeline's time breakdown


class TrainStep(Protocol):
    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def make_loss_scaler(args: argparse.Namespace) -> DynamicLossScaler:
    return DynamicLossScaler(args.initial_loss_scale, growth_interval=args.loss_scale_window,
                             min_scale=args.min_loss_scale)


class LocalTrainStep:
    """Whole model in one process: working params in the training dtype, fp32 masters."""

    def __init__(self, model_cfg: LlamaConfig, args: argparse.Namespace) -> None:
        self.dtype = training_dtype(args)
        # Initialize in fp32 so every precision starts from the same master weights.
        self.model = LlamaModel(model_cfg.with_dtype(torch.float32))
        named = [(n, p) for n, p in self.model.named_parameters()]
        self.masters = [p.detach().clone().float() for _, p in named]
        if self.dtype != torch.float32:
            self.model.to(self.dtype)
        self.params = [p for _, p in named]
        decay = [m for (n, p), m in zip(named, self.masters) if uses_weight_decay(n, p)]
        no_decay = [m for (n, p), m in zip(named, self.masters) if not uses_weight_decay(n, p)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        )
        self.clip_grad = args.clip_grad
        self.inject_overflow_at = args.inject_overflow[0] if args.inject_overflow else None
        self.scaler = make_loss_scaler(args) if self.dtype == torch.float16 else None

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult:
        for p in self.params:
            p.grad = None
        scale = self.scaler.scale if self.scaler else 1.0
        total = 0.0
        for batch in micro_batches:
            loss = self.model(batch) / len(micro_batches)
            (loss * scale).backward()
            total += float(loss.detach())
        if self.inject_overflow_at == iteration:
            self.params[0].grad.view(-1)[0] = float("inf")
        for master, p in zip(self.masters, self.params):
            master.grad = p.grad.detach().float().div_(scale)
        grads = [m.grad for m in self.masters]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        overflow = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(overflow)
        if overflow:
            return StepResult(total, skipped=True, grad_norm=norm, loss_scale=scale)
        if self.clip_grad > 0 and norm > self.clip_grad:
            for g in grads:
                g.mul_(self.clip_grad / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = weight_decay * group["wd_mult"]
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)
        return StepResult(total, grad_norm=norm, loss_scale=scale if self.scaler else None)

    def master_state(self) -> dict[str, torch.Tensor]:
        names = [n for n, _ in self.model.named_parameters()]
        return dict(zip(names, self.masters))

    def state_dict(self) -> dict:
        return {
            "model": self.master_state(),
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for (name, master), p in zip(self.master_state().items(), self.params):
                master.copy_(state["model"][name])
                p.copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])


def iteration_micro_batches(dataset, iteration: int, args: argparse.Namespace) -> list[Batch]:
    """Micro-batches of `iteration` (1-based): a fixed slice of the sample order, so every
    process of a pipeline and every resumed run sees the same data."""
    from megatron.training.data import micro_batch_at

    count = args.global_batch_size // args.micro_batch_size
    first = (iteration - 1) * count
    return [micro_batch_at(dataset, args.micro_batch_size, first + j) for j in range(count)]


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=vocab_size,
        seq_length=args.seq_length,
        seed=args.seed,
    )


def print_model_size(args: argparse.Namespace) -> None:
    from megatron.models.presets import (
        MODEL_STATE_BYTES_PER_PARAM,
        count_parameters,
        count_parameters_full_mha,
    )

    vocab = args.vocab_size or 32000
    c = count_parameters(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                         args.num_attention_heads, args.num_query_groups, vocab)
    mha = count_parameters_full_mha(args.num_layers, args.hidden_size, args.ffn_hidden_size, vocab)
    gib = c.total * MODEL_STATE_BYTES_PER_PARAM / 2**30
    print(f"model: {args.model_preset or 'custom'}  layers={args.num_layers} "
          f"hidden={args.hidden_size} ffn={args.ffn_hidden_size} heads={args.num_attention_heads} "
          f"kv_heads={args.num_query_groups} vocab={vocab}")
    print(f"parameters: {c.total:,} ({c.total / 1e9:.2f} B): embedding {c.embedding:,}, "
          f"{args.num_layers} layers x {c.per_layer:,}, head {c.head:,}")
    print(f"model states (mixed-precision Adam, {MODEL_STATE_BYTES_PER_PARAM} bytes/param): "
          f"{gib:,.1f} GiB")
    print(f"with full multi-head attention (the paper's size column): {mha / 1e9:.2f} B")


def prepare_data(args: argparse.Namespace, log=print):
    """The tokenizer and the training dataset; the demo corpus when no --data-path."""
    from megatron.training import data as data_mod
    from megatron.training.demo_corpus import ensure_demo_corpus
    from megatron.training.tokenizer import TokenizerError, load_tokenizer

    if args.data_path is None:
        corpus = ensure_demo_corpus(cache_dir=args.data_cache_dir, log=log)
        data_path, tokenizer_path = corpus.data_prefix, corpus.tokenizer_path
        if args.tokenizer_model is not None:
            tokenizer_path = args.tokenizer_model
    else:
        data_path, tokenizer_path = args.data_path, args.tokenizer_model
        try:
            data_mod.check_data_prefix(data_path)
        except data_mod.DataError as exc:
            raise ArgumentError("--data-path", data_path, str(exc)) from None
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (TokenizerError, OSError) as exc:
        raise ArgumentError("--tokenizer-model", tokenizer_path, str(exc)) from None
    vocab = args.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ArgumentError("--vocab-size", vocab,
                            f"must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})")
    num_samples = args.train_iters * args.global_batch_size
    try:
        dataset = data_mod.build_train_dataset(
            data_path, tokenizer, args.seq_length, num_samples, args.seed,
            cache_dir=args.data_cache_dir,
        )
    except data_mod.DataError as exc:
        raise ArgumentError("--data-path", data_path, str(exc)) from None
    return tokenizer, dataset, vocab


def make_train_step(args: argparse.Namespace, model_cfg: LlamaConfig, dist_info) -> TrainStep:
    if dist_info.world_size == 1 and args.pipeline_schedule in (None, "single"):
        return LocalTrainStep(model_cfg, args)
    from megatron.pipeline.train_step import PipelineTrainStep

    return PipelineTrainStep(model_cfg, args, dist_info)


def train(args: argparse.Namespace, dist_info, on_step=None) -> list[dict]:
    """Train with `args` in an initialized process group; returns the per-iteration
    metrics. Callable several times in one job (bench/schedules.py runs each schedule);
    `on_step(train_step)` is called once the train step is built."""
    if args.save:
        check_writable_dir("--save", args.save)
    if dist_info.world_size > 1 or args.pipeline_schedule not in (None, "single"):
        from megatron.pipeline.train_step import check_pipeline_args

        check_pipeline_args(args, dist_info.world_size)
    is_logger = dist_info.rank == dist_info.world_size - 1 or dist_info.world_size == 1
    log = print if dist_info.rank == 0 else (lambda *_: None)
    metrics, step, records = None, None, []
    try:
        _, dataset, vocab = prepare_data(args, log=log)
        model_cfg = model_config_from_args(args, vocab)
        torch.manual_seed(args.seed)
        step = make_train_step(args, model_cfg, dist_info)
        if on_step is not None:
            on_step(step)
        schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                              args.lr_decay_style, args.weight_decay)
        start_iteration, skipped_total = 0, 0
        if args.load:
            loaded = load_checkpoint(args.load, rank=dist_info.rank)
            if loaded is not None:
                start_iteration, state = loaded
                step.load_state_dict(state["train_step"])
                schedule.load_state_dict(state["lr_schedule"])
                skipped_total = state.get("skipped_total", 0)
                log(f"loaded checkpoint from {args.load} at iteration {start_iteration}")
        # The metrics come from the process that sees the loss (the last rank of a pipeline
        # reports it to all, so any one rank would do; keep one writer per job).
        metrics = MetricsWriter(args.metrics_file if is_logger else None)
        tokens_per_iter = args.global_batch_size * args.seq_length
        log(f"training {args.model_preset or 'custom'} model: {args.train_iters} iterations, "
            f"{args.global_batch_size // args.micro_batch_size} micro-batches of "
            f"{args.micro_batch_size} x {args.seq_length} tokens, {dtype_name(args)}")
        for iteration in range(start_iteration + 1, args.train_iters + 1):
            micro_batches = iteration_micro_batches(dataset, iteration, args)
            t0 = time.perf_counter()
            result = step.step(iteration, micro_batches, schedule.lr, schedule.weight_decay)
            elapsed = time.perf_counter() - t0
            lr_used = schedule.lr
            schedule.step()
            skipped_total += int(result.skipped)
            record = {
                "iteration": iteration,
                "loss": result.loss,
                "lr": lr_used,
                "iter_time_s": elapsed,
                "tokens_per_s": tokens_per_iter / elapsed,
                "consumed_samples": iteration * args.global_batch_size,
                "global_batch_size": args.global_batch_size,
                "skipped": result.skipped,
                "skipped_total": skipped_total,
                "loss_scale": result.loss_scale,
                "grad_norm": result.grad_norm,
                **result.extra,
            }
            metrics.write(record)
            records.append(record)
            if is_logger and (iteration % args.log_interval == 0 or iteration == 1):
                print(format_log_line(record, args.train_iters), flush=True)
            save_now = args.save and (
                iteration == args.train_iters
                or (args.save_interval and iteration % args.save_interval == 0)
            )
            if save_now:
                state = {"train_step": step.state_dict(), "lr_schedule": schedule.state_dict(),
                         "skipped_total": skipped_total, "args": vars(args)}
                import torch.distributed as dist

                path = save_checkpoint(args.save, iteration, state, rank=dist_info.rank,
                                       barrier=dist.barrier)
                log(f"saved checkpoint to {path}")
    finally:
        close = getattr(step, "close", None)
        if close:
            close()
        if metrics is not None:
            metrics.close()
    return records


def dtype_name(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_model_size:
        print_model_size(args)
        return 0
    from megatron.training.distributed import initialize_distributed, shutdown_distributed

    try:
        dist_info = initialize_distributed()
        try:
            train(args, dist_info)
        finally:
            shutdown_distributed()
    except (ArgumentError, CheckpointError) as exc:
        exit_bad_input(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
