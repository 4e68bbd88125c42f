"""The training loop: data, model, optimizer step, LR schedule, logging, metrics, checkpoints.

The loop is the same for one process and for a pipeline: what differs is the `TrainStep`
that runs one iteration over its micro-batches (`LocalTrainStep`, the one-process reference,
or `PipelineTrainStep`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.models.llama import Batch, LlamaConfig
from megatron.models.presets import (
    MODEL_STATE_BYTES_PER_PARAM,
    count_parameters,
    count_parameters_full_mha,
)
from megatron.pipeline.host_group import host_group
from megatron.training.arguments import (
    ArgumentError,
    check_writable_dir,
    exit_bad_input,
    parse_args,
)
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron.training.data_checks import DataError, check_data_prefix
from megatron.training.demo_corpus import ensure_demo_corpus
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.local_step import LocalTrainStep
from megatron.training.lr_schedule import LRSchedule
from megatron.training.metrics import MetricsWriter, format_log_line
from megatron.training.pipeline_args import check_pipeline_args
from megatron.training.pipeline_step import PipelineTrainStep
from megatron.training.plan import configure_automatically, run_plan
from megatron.training.tokenizer import TokenizerError, load_tokenizer
from megatron.training.train_dataset import build_train_dataset, micro_batch_at
from megatron.training.train_step import TrainStep


def iteration_micro_batches(dataset, iteration: int, args: argparse.Namespace) -> list[Batch]:
    """Micro-batches of `iteration` (1-based): a fixed slice of the sample order, so every
    process of a pipeline and every resumed run sees the same data."""
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
    if args.data_path is None:
        corpus = ensure_demo_corpus(cache_dir=args.data_cache_dir, log=log)
        data_path, tokenizer_path = corpus.data_prefix, corpus.tokenizer_path
        if args.tokenizer_model is not None:
            tokenizer_path = args.tokenizer_model
    else:
        data_path, tokenizer_path = args.data_path, args.tokenizer_model
        try:
            check_data_prefix(data_path)
        except DataError as exc:
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
        dataset = build_train_dataset(
            data_path, tokenizer, args.seq_length, num_samples, args.seed,
            cache_dir=args.data_cache_dir,
        )
    except DataError as exc:
        raise ArgumentError("--data-path", data_path, str(exc)) from None
    return tokenizer, dataset, vocab


def runs_pipeline(args: argparse.Namespace, world_size: int) -> bool:
    """One process without a pipeline flag trains the whole model locally."""
    return (world_size > 1 or args.pipeline_schedule not in (None, "single")
            or args.schedule_file is not None)


def make_train_step(args: argparse.Namespace, model_cfg: LlamaConfig, dist_info) -> TrainStep:
    if not runs_pipeline(args, dist_info.world_size):
        return LocalTrainStep(model_cfg, args)
    return PipelineTrainStep(model_cfg, args, dist_info)


def train(args: argparse.Namespace, dist_info, on_step=None) -> list[dict]:
    """Train with `args` in an initialized process group; returns the per-iteration
    metrics. Callable several times in one job (bench/schedules.py runs each schedule);
    `on_step(train_step)` is called once the train step is built."""
    if runs_pipeline(args, dist_info.world_size):
        check_pipeline_args(args, dist_info.world_size)
    if args.save:
        check_writable_dir("--save", args.save)
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
                path = save_checkpoint(args.save, iteration, state, rank=dist_info.rank,
                                       barrier=lambda: dist.barrier(group=host_group()))
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
    if args.plan:
        try:
            return run_plan(args)
        except ArgumentError as exc:
            exit_bad_input(exc)
    try:
        if args.auto_config:
            args = configure_automatically(args)
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
