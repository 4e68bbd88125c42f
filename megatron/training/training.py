"""The training loop: data, model, optimizer step, LR schedule, logging, metrics, checkpoints.

The loop is the same for one process and for a pipeline: what differs is the `TrainStep`
that runs one iteration over its micro-batches (`LocalTrainStep`, the one-process reference,
or `PipelineTrainStep`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    exit_bad_input,
    parse_args,
)
from megatron.training.checkpointing import (
    CheckpointError,
    CheckpointSaver,
    check_resumable,
    load_checkpoint,
    restore_run,
)
from megatron.training.data_blend import Datasets, data_blend_from_args, evaluations, split_sizes
from megatron.training.data_checks import DataError
from megatron.training.demo_corpus import ensure_demo_corpus
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.evaluation import due, evaluate, evaluation_record, format_evaluation
from megatron.training.local_step import LocalTrainStep
from megatron.training.lr_schedule import LRSchedule
from megatron.training.metrics import MetricsWriter, format_host_memory, format_log_line
from megatron.training.pipeline_args import check_pipeline_args, optimizer_bytes_per_param
from megatron.training.pipeline_step import PipelineTrainStep
from megatron.training.plan import configure_automatically, run_plan
from megatron.training.run_checks import (
    check_checkpoint_args,
    check_load_dir,
    check_output_paths,
)
from megatron.training.scalar_logging import ScalarSinks, check_scalar_sinks
from megatron.training.signals import ExitConditions
from megatron.training.tokenizer import TokenizerError, load_tokenizer
from megatron.training.train_dataset import build_datasets, micro_batch_at
from megatron.training.train_step import TrainStep


def iteration_micro_batches(dataset, iteration: int, args: argparse.Namespace,
                            data_parallel_rank: int = 0) -> list[Batch]:
    """Micro-batches of `iteration` (1-based): a fixed slice of the sample order, so every
    process of a pipeline and every resumed run sees the same data. With data
    parallelism, this replica's share, as Megatron's sampler splits a global batch: step
    j of the D replicas takes the j-th D micro-batches, replica r the r-th of them."""
    d = getattr(args, "data_parallel_size", 1)
    count = args.global_batch_size // (args.micro_batch_size * d)
    first = (iteration - 1) * count * d
    return [micro_batch_at(dataset, args.micro_batch_size, first + j * d + data_parallel_rank)
            for j in range(count)]


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
    optimizer = optimizer_bytes_per_param(args)
    print(f"host optimizer state (master {args.master_dtype}, m and v "
          f"{args.optimizer_state_dtype}): {optimizer} bytes/param, "
          f"{c.total * optimizer / 2**30:,.1f} GiB")


def prepare_data(args: argparse.Namespace, log=print):
    """The tokenizer and the train/validation/test datasets (Datasets); the demo corpus
    when no data path is given."""
    default_prefix, tokenizer_path = None, args.tokenizer_model
    if args.data_path is None and args.train_data_path is None:
        corpus = ensure_demo_corpus(cache_dir=args.data_cache_dir, log=log)
        default_prefix = corpus.data_prefix
        if args.tokenizer_model is None:
            tokenizer_path = corpus.tokenizer_path
    blend = data_blend_from_args(args, default_prefix)
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (TokenizerError, OSError) as exc:
        raise ArgumentError("--tokenizer-model", tokenizer_path, str(exc)) from None
    vocab = args.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ArgumentError("--vocab-size", vocab,
                            f"must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})")
    flag = "--data-path" if args.train_data_path is None else "--train-data-path"
    try:
        train_ds, valid_ds, test_ds = build_datasets(
            blend, tokenizer, args.seq_length, split_sizes(args), args.seed,
            cache_dir=args.data_cache_dir,
        )
    except DataError as exc:
        raise ArgumentError(flag, " ".join(blend.all_prefixes()), str(exc)) from None
    if train_ds is None:
        raise ArgumentError("--split" if args.split else flag, args.split or "missing",
                            "expected a training share (the first weight) above 0")
    if args.eval_iters > 0 and valid_ds is None:
        raise ArgumentError("--eval-iters", args.eval_iters,
                            "the validation split is empty: give --split a validation share "
                            "or --valid-data-path")
    return tokenizer, Datasets(train_ds, valid_ds, test_ds), vocab


def runs_pipeline(args: argparse.Namespace, world_size: int) -> bool:
    """One process without a pipeline flag trains the whole model locally."""
    return (world_size > 1 or args.pipeline_schedule not in (None, "single")
            or args.schedule_file is not None
            or "bf16" in (args.optimizer_state_dtype, args.master_dtype))  # CPU optimizer only


def make_train_step(args: argparse.Namespace, model_cfg: LlamaConfig, dist_info) -> TrainStep:
    if not runs_pipeline(args, dist_info.world_size):
        return LocalTrainStep(model_cfg, args)
    return PipelineTrainStep(model_cfg, args, dist_info)


def train(args: argparse.Namespace, dist_info, on_step=None) -> list[dict]:
    """Train with `args` in an initialized process group; returns the per-iteration
    metrics. Callable several times in one job (bench/schedules.py runs each schedule);
    `on_step(train_step)` is called once the train step is built."""
    start_time = time.time()
    if args.data_parallel_size != dist_info.data_parallel_size:
        raise ArgumentError("--data-parallel-size", args.data_parallel_size,
                            f"this job's process groups were built for "
                            f"{dist_info.data_parallel_size}")
    # --pipeline-model-parallel-size is checked on one process too: a launch that forgot
    # torchrun must not train the whole model locally instead
    if runs_pipeline(args, dist_info.world_size) or args.pipeline_model_parallel_size:
        check_pipeline_args(args, dist_info.pipeline_size)
    check_load_dir(args)  # the checks that create nothing first
    check_scalar_sinks(args)
    check_output_paths(args)
    is_logger = dist_info.rank == dist_info.world_size - 1 or dist_info.world_size == 1
    log = print if dist_info.rank == 0 else (lambda *_: None)
    metrics, step, sinks, exits, records, saver = None, None, None, None, [], None
    try:
        with setup_phase("checkpoint read", log, enabled=bool(args.load)):
            if args.load and os.path.isdir(args.load):
                saved = check_resumable(args)
                if saved is None:
                    log(f"no checkpoint in {args.load}: starting from scratch")
                else:
                    check_checkpoint_args(args, saved.get("args"), args.load)
            elif args.load:
                log(f"{args.load} does not exist (--load-optional): starting from scratch")
        with setup_phase("data", log):
            tokenizer, datasets, vocab = prepare_data(args, log=log)
        model_cfg = model_config_from_args(args, vocab)
        torch.manual_seed(args.seed)
        with setup_phase("model, optimizer and pipeline", log):
            step = make_train_step(args, model_cfg, dist_info)
        if on_step is not None:
            on_step(step)
        schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                              args.lr_decay_style, args.weight_decay)
        start_iteration, skipped_total = 0, 0
        if args.load and os.path.isdir(args.load):
            with setup_phase("checkpoint load", log):
                common = load_checkpoint(args.load, step.owned_state(), finetune=args.finetune)
                if common is not None:
                    start_iteration, skipped_total = restore_run(common, step, schedule, args)
            if common is not None:
                log(f"loaded checkpoint from {args.load} at iteration {common['iteration']}"
                    + (" (--finetune: weights only, from iteration 0)" if args.finetune else ""))
        if args.save:
            saver = CheckpointSaver(args.save, async_save=args.async_save, log=log)
        # The metrics come from the process that sees the loss (the last rank of a pipeline
        # reports it to all, so any one rank would do; keep one writer per job).
        metrics = MetricsWriter(args.metrics_file if is_logger else None)
        sinks = ScalarSinks(args, enabled=is_logger)
        agree = None
        if dist_info.world_size > 1:
            def agree(flags: torch.Tensor) -> None:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group())
        exits = ExitConditions(args, start_time, agree)
        tokens_per_iter = args.global_batch_size * args.seq_length
        log(f"training {args.model_preset or 'custom'} model: {args.train_iters} iterations, "
            f"{args.global_batch_size // args.micro_batch_size} micro-batches of "
            f"{args.micro_batch_size} x {args.seq_length} tokens, {dtype_name(args)}")
        if isinstance(step, PipelineTrainStep):
            log(format_host_memory(step.host_memory()))
        stopped = None
        for iteration in range(start_iteration + 1, args.train_iters + 1):
            micro_batches = iteration_micro_batches(datasets.train, iteration, args,
                                                    dist_info.data_parallel_rank)
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
                "eta_s": eta_seconds(records, elapsed, args.train_iters - iteration),
                **result.extra,
            }
            metrics.write(record)
            sinks.training(record)
            records.append(record)
            if is_logger and (iteration % args.log_interval == 0 or iteration == 1):
                print(format_log_line(record, args.train_iters), flush=True)
            if due(iteration, args):
                run_evaluation(step, datasets.valid, iteration // args.eval_interval - 1,
                               iteration, f"iteration {iteration}", "validation", args,
                               metrics, sinks, is_logger)
            stopped = exits.reason(iteration)
            if iteration == args.train_iters:
                stopped = None  # the normal end: its evaluations still run
            save_now = args.save and (
                iteration == args.train_iters or stopped is not None
                or (args.save_interval and iteration % args.save_interval == 0)
            )
            if save_now:
                common = {"lr_schedule": schedule.state_dict(), "skipped_total": skipped_total,
                          "consumed_samples": iteration * args.global_batch_size,
                          "args": vars(args), "tokenizer_json": tokenizer.to_json()}
                blocked = saver.save(iteration, step.owned_state(), common)
                log(f"checkpoint iteration {iteration}: training blocked {blocked:.3f} s"
                    + (", writing in the background" if args.async_save else ""))
            if stopped is not None:
                log(f"exiting after iteration {iteration}: {stopped}")
                break
        if stopped is None and args.eval_iters > 0:
            run_evaluation(step, datasets.valid, evaluations(args) - 1, args.train_iters,
                           "the end of training for val data", "validation", args, metrics,
                           sinks, is_logger, end_of_training=True)
            if datasets.test is not None:
                run_evaluation(step, datasets.test, 0, args.train_iters,
                               "the end of training for test data", "test", args, metrics,
                               sinks, is_logger, end_of_training=True)
    finally:
        if saver is not None:
            saver.close()  # the last save in flight completes
        if exits is not None:
            exits.close()
        close = getattr(step, "close", None)
        if close:
            close()
        if metrics is not None:
            metrics.close()
        if sinks is not None:
            sinks.close()
    return records


def run_evaluation(step: TrainStep, dataset, number: int, iteration: int, where: str,
                   split: str, args: argparse.Namespace, metrics: MetricsWriter,
                   sinks: ScalarSinks, is_logger: bool, end_of_training: bool = False) -> dict:
    """Evaluate on every rank; the logging rank prints Megatron's block and records it."""
    loss = evaluate(step, dataset, number, args)
    record = evaluation_record(iteration, split, loss, end_of_training)
    metrics.write(record)
    sinks.evaluation(record, iteration * args.global_batch_size)
    if is_logger:
        print(format_evaluation(where, loss), flush=True)
    return record


def eta_seconds(records: list[dict], elapsed: float, remaining: int) -> float:
    """Remaining iterations times the mean iteration time of this run so far, the first
    (warm-up) iteration left out once there are others."""
    times = [r["iter_time_s"] for r in records[1:]] + [elapsed] if records else [elapsed]
    return remaining * sum(times) / len(times)


@contextlib.contextmanager
def setup_phase(name: str, log, enabled: bool = True):
    """One line per setup phase with its time (the first iteration of a large model waits
    for segment creation and the pipeline's assembly)."""
    t0 = time.perf_counter()
    yield
    if enabled:
        log(f"setup: {name} done in {time.perf_counter() - t0:.1f} s")


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
        dist_info = initialize_distributed(data_parallel_size=args.data_parallel_size)
        try:
            train(args, dist_info)
        finally:
            shutdown_distributed()
    except (ArgumentError, CheckpointError) as exc:
        exit_bad_input(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
