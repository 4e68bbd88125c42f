"""The training loop: data, model, optimizer step, LR schedule, logging, metrics, checkpoints.

The loop is the same for one process and for a pipeline: what differs is the `TrainStep`
that runs one iteration over its micro-batches (`LocalTrainStep`, the one-process reference,
or `PipelineTrainStep`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron.common.progress import progress_enabled
from megatron.common.save_lock import SaveLock
from megatron.config.checks import run_notices
from megatron.config.errors import ConfigError
from megatron.config.launcher_env import check_launcher_env
from megatron.config.run import RunConfig
from megatron.data.run_data import RunData, prepare_data
from megatron.data.sampling import training_micro_batches
from megatron.models.attention import forget_kernels_run, kernels_run
from megatron.models.llama import LlamaConfig, layer_implementation
from megatron.optimizer.disk_states import DiskStateError
from megatron.pipeline.host_group import host_group
from megatron.pipeline.node_memory import (
    PinningShortfall,
    SegmentInUseError,
    ShmSpaceError,
    memlock_limit,
    memlock_shortfall,
)
from megatron.planning.evaluate import plan_hardware, run_hardware
from megatron.planning.report import candidates_text, model_size, run_plan
from megatron.planning.search import auto_configure
from megatron.planning.shape import check_pipeline_shape
from megatron.schedules.cost_model import megatron_model_flops_per_token
from megatron.training.arguments import exit_bad_input, parse_args
from megatron.training.checkpoint_format import saved_args, saved_vocab_rows
from megatron.training.checkpointing import (
    CheckpointError,
    CheckpointSaver,
    CheckpointWriteError,
    check_resumable,
    load_checkpoint,
    reading_checkpoint,
    restore_run,
)
from megatron.training.distributed import (
    DistInfo,
    PeerTimeout,
    collective_timeout,
    initialize_distributed,
    peer_gone,
    shutdown_distributed,
    timed_out,
)
from megatron.training.evaluation import due, evaluate, evaluation_record, format_evaluation
from megatron.training.fit_check import refuse_single_process_that_does_not_fit
from megatron.training.local_step import LocalTrainStep
from megatron.training.lr_schedule import LRSchedule
from megatron.training.metrics import (
    LogInterval,
    MetricsWriter,
    format_host_memory,
    format_log_line,
)
from megatron.training.pipeline_step import PipelineTrainStep
from megatron.training.process_limits import check_process_limits
from megatron.training.profiling import IterationProfiler
from megatron.training.run_checks import (
    check_checkpoint_model,
    check_checkpoint_vocabulary,
    check_load_dir,
    check_nvme_space,
    check_output_paths,
    check_save_space,
    check_schedule_size,
    is_auto_resume,
    resume_shape_notice,
)
from megatron.training.run_summary import RunOutcome, format_run_summary
from megatron.training.save_lock import hold_save_directory, keep_save_directory
from megatron.training.scalar_logging import ScalarSinks, check_scalar_sinks
from megatron.training.signals import INTERRUPT, INTERRUPTED_STATUS, ExitConditions
from megatron.training.timeouts import waited_too_long
from megatron.training.train_step import TrainStep, on_device

Log = Callable[[str], object]


def runs_pipeline(run: RunConfig, world_size: int) -> bool:
    """A pipeline of one process without a pipeline flag trains the whole model locally
    (each data-parallel replica, with --pipeline-model-parallel-size 1)."""
    p = run.parallel
    return (world_size // run.data_parallel_size > 1
            or p.names_pipeline_schedule
            or p.schedule_file is not None
            or "bf16" in (run.precision.optimizer_state_dtype,  # the CPU optimizer only
                          run.precision.master_dtype)
            or run.cpu_optimizer.placement.states.on_nvme)  # its disk tier too


def make_train_step(run: RunConfig, model_cfg: LlamaConfig, dist_info: DistInfo) -> TrainStep:
    if not runs_pipeline(run, dist_info.world_size):
        refuse_single_process_that_does_not_fit(run, model_cfg.vocab_size, dist_info.device)
        return LocalTrainStep(model_cfg, run, dist_info.torch_device)
    return PipelineTrainStep(model_cfg, run, dist_info)


def check_before_start(run: RunConfig, dist_info: DistInfo) -> None:
    """What needs the process group or the file system, before anything is created."""
    if run.data_parallel_size != dist_info.data_parallel_size:
        raise ConfigError("--data-parallel-size", run.data_parallel_size,
                          f"this job's process groups were built for "
                          f"{dist_info.data_parallel_size}")
    # --pipeline-model-parallel-size is checked on one process too: a launch that forgot
    # torchrun must not train the whole model locally instead
    if runs_pipeline(run, dist_info.world_size) or (
            run.parallel.pipeline_model_parallel_size or 1) > 1:
        check_pipeline_shape(run, dist_info.pipeline_size)
        check_schedule_size(run, dist_info.pipeline_size)  # before the data phase writes
    run_hardware(run)  # --hardware's profile (the plan is priced on it): read and checked
    check_load_dir(run)  # the checks that create nothing first
    check_scalar_sinks(run)
    check_output_paths(run)
    check_save_space(run, run.vocab_size_given)  # again with the tokenizer's vocabulary
    check_nvme_space(run, run.vocab_size_given)


class TrainingLoop:
    """One run in an initialized process group: what it set up (data, train step, LR
    schedule, writers) and what it recorded. `close()` releases everything it holds."""

    def __init__(self, run: RunConfig, dist_info: DistInfo, start_time: float,
                 save_lock: SaveLock | None = None) -> None:
        self.run = run
        self.save_lock = save_lock  # rank 0's, of --save (kept through the run)
        self.dist_info = dist_info
        self.start_time = start_time
        # The metrics come from the process that sees the loss (the last rank of a pipeline
        # reports it to all, so any one rank would do; keep one writer per job).
        self.is_logger = dist_info.rank == dist_info.world_size - 1 or dist_info.world_size == 1
        self.log: Log = print if dist_info.rank == 0 else (lambda *_: None)
        self.records: list[dict] = []
        self.data: RunData | None = None
        self.step: TrainStep | None = None
        self.schedule: LRSchedule | None = None
        self.saver: CheckpointSaver | None = None
        self.metrics: MetricsWriter | None = None
        self.sinks: ScalarSinks | None = None
        self.exits: ExitConditions | None = None
        self.start_iteration = 0
        self.iteration = 0  # the one running (0: setting up)
        self.last_saved: int | None = None
        self.skipped_total = 0
        self.interval = LogInterval()  # what the next iteration line reports
        self.flops_per_token = 0.0  # model FLOPs, for --log-throughput
        self.model_cfg: LlamaConfig | None = None
        self.pinning: PinningShortfall | None = None  # page-locked memory over ulimit -l

    # --- setup ---------------------------------------------------------------------------

    def set_up(self, on_step: Callable[[TrainStep], None] | None = None) -> None:
        run, log = self.run, self.log
        forget_kernels_run()  # this run's, for the metrics' attention_kernel
        self.layer_implementation = layer_implementation()
        load = run.checkpointing.load
        saved = None
        with setup_phase("checkpoint read", log, enabled=bool(load)), reading_checkpoint(load):
            why = "--save directory: auto-resume" if is_auto_resume(run) else "--load-optional"
            if load and os.path.isdir(load):
                saved = check_resumable(run, log)
                if saved is None and run.checkpointing.exit_on_missing_checkpoint:
                    raise CheckpointError(f"--load {load}: holds no checkpoint "
                                          "(--exit-on-missing-checkpoint)")
                if saved is None:
                    log(f"no checkpoint in {load}: starting from scratch"
                        + (f" ({why})" if is_auto_resume(run) else ""))
                else:
                    check_checkpoint_model(run, saved_args(saved), load,
                                           saved_vocab_rows(saved))
                    notice = resume_shape_notice(run, saved, self.dist_info.world_size, load)
                    if notice:
                        log(notice)
            elif load:
                log(f"no checkpoint in {load}: starting from scratch ({why}; the directory "
                    "does not exist yet)")
        if not runs_pipeline(run, self.dist_info.world_size):
            # before the data: the vocabulary given, or 1 (a lower bound; checked again
            # with the tokenizer's below), so that a run far too large stops at once
            refuse_single_process_that_does_not_fit(run, run.vocab_size_given or 1,
                                                    self.dist_info.device)
        with setup_phase("data", log):
            self.data = prepare_data(run, log=log)
        if saved is not None:  # with the tokenizer's vocabulary, before the model
            check_checkpoint_vocabulary(run, saved_args(saved), load, saved_vocab_rows(saved),
                                        self.data.vocab_size)
        check_save_space(run, self.data.vocab_size)  # the real checkpoint's bytes
        check_nvme_space(run, self.data.vocab_size)
        if saved is not None and saved.get("tokenizer_json") not in (
                None, self.data.tokenizer.to_json()):
            warn(f"the checkpoint in {load} was saved with another tokenizer (of the same "
                 "vocabulary size): its token ids stand for other text now", self.dist_info)
        model_cfg = LlamaConfig.from_model(run.model, self.data.vocab_size, run.training.seed)
        self.flops_per_token = megatron_model_flops_per_token(
            replace(run.model, vocab_size=self.data.vocab_size))
        self.model_cfg = model_cfg
        torch.manual_seed(run.training.seed)
        with setup_phase("model, optimizer and pipeline", log):
            self.step = make_train_step(run, model_cfg, self.dist_info)
        if on_step is not None:
            on_step(self.step)
        self.schedule = LRSchedule(run)
        if load and os.path.isdir(load):
            self._load(load)
        if run.checkpointing.save:
            self.saver = CheckpointSaver(run.checkpointing.save, model_cfg,
                                         async_save=run.checkpointing.async_save, log=log)
        self.metrics = MetricsWriter(run.logging.metrics_file if self.is_logger else None)
        self.sinks = ScalarSinks(run, enabled=self.is_logger)
        agree = None
        if self.dist_info.world_size > 1:
            def agree(flags: torch.Tensor) -> None:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group())
        self.exits = ExitConditions(run.exit, self.start_time, agree)

    def _load(self, load: str) -> None:
        c = self.run.checkpointing
        finetune = c.finetune
        with setup_phase("checkpoint load", self.log), reading_checkpoint(load):
            common = load_checkpoint(load, self.step.owned_state(), self.model_cfg,
                                     finetune=finetune, load_optim=not c.no_load_optim,
                                     load_rng=not c.no_load_rng, log=self.log,
                                     verify=False)  # check_resumable() verified the files
            if common is not None:
                self.start_iteration, self.skipped_total = restore_run(
                    common, self.step, self.schedule, finetune, self.log)
        if common is not None:
            self.log(f"loaded checkpoint from {load} at iteration {common.get('iteration', 0)}"
                     + (" (--finetune: weights only, from iteration 0)" if finetune else ""))
        train_iters = self.run.training.train_iters
        if self.start_iteration >= train_iters:
            # Megatron's loop does not run and the job ends normally (exit status 0)
            warn(f"the checkpoint in {load} is already at iteration {self.start_iteration} "
                 f">= --train-iters {train_iters}: nothing to train", self.dist_info)

    # --- the loop ------------------------------------------------------------------------

    def train(self) -> None:
        run, log = self.run, self.log
        t = run.training
        log(f"training {run.model.name} model: {t.train_iters} iterations, "
            f"{run.micro_batches * run.data_parallel_size} micro-batches of "
            f"{t.micro_batch_size} x {run.model.seq_length} tokens, {run.precision.dtype}")
        if isinstance(self.step, PipelineTrainStep):
            memory = self.step.host_memory()
            log(format_host_memory(memory))
            self.pinning = memlock_shortfall(memory["pinned_bytes_per_process"],
                                             memlock_limit(self.dist_info.device.kind))
            if self.pinning is not None:
                warn(self.pinning.startup_line(), self.dist_info)
        stopped = None
        profiler = IterationProfiler(run, self.dist_info.rank)
        try:
            for iteration in range(self.start_iteration + 1, t.train_iters + 1):
                profiler.before(iteration)
                self._iteration(iteration)
                profiler.after(iteration)
                stopped = self._after_iteration(iteration)
                if stopped is not None:
                    break
        finally:
            profiler.close()
        self._after_training(stopped)
        pipeline = isinstance(self.step, PipelineTrainStep)
        outcome = RunOutcome(self.records, self.start_iteration, stopped, self.last_saved,
                             time.time() - self.start_time, pipeline, self.pinning,
                             self.step.plan.prediction if pipeline else None)
        log(format_run_summary(run, outcome))

    def _after_iteration(self, iteration: int) -> str | None:
        """Evaluation, checkpoint and exit conditions after `iteration`: why training stops
        (None: it goes on, or ended normally)."""
        run, log, t = self.run, self.log, self.run.training
        if due(iteration, run):
            self.evaluate(self.data.datasets.valid,
                          iteration // run.eval_interval - 1, iteration,
                          f"iteration {iteration}", "validation")
        stopped = self.exits.reason(iteration)
        if iteration == t.train_iters:
            stopped = None  # the normal end: its evaluations still run
        interval = run.checkpointing.save_interval
        if run.checkpointing.save and (iteration == t.train_iters or stopped is not None
                                       or (interval and iteration % interval == 0)):
            self.save(iteration)
        if stopped is not None:
            log(self.exits.exit_line(iteration, stopped))
        return stopped

    def _after_training(self, stopped: str | None) -> None:
        run = self.run
        t = run.training
        if stopped is None and run.eval_iters > 0:
            datasets = self.data.datasets
            self.evaluate(datasets.valid, run.evaluations - 1, t.train_iters,
                          f"iteration {t.train_iters} on validation set", "validation",
                          end=True)
            if datasets.test is not None:
                self.evaluate(datasets.test, 0, t.train_iters,
                              f"iteration {t.train_iters} on test set", "test", end=True)

    def _iteration(self, iteration: int) -> None:
        run, schedule = self.run, self.schedule
        INTERRUPT.iteration = self.iteration = iteration
        started = time.perf_counter()  # the line's time: the batch's reading included
        micro_batches = on_device(
            training_micro_batches(self.data.datasets.train, iteration, run,
                                   self.dist_info.data_parallel_rank),
            self.dist_info.torch_device)
        t0 = time.perf_counter()
        result = self.step.step(iteration, micro_batches, schedule.lr, schedule.weight_decay)
        elapsed = time.perf_counter() - t0
        if not result.skipped:  # Megatron steps the schedule only after an update
            schedule.step()
        self.skipped_total += int(result.skipped)
        batch = run.training.global_batch_size
        record = {
            "iteration": iteration,
            "loss": result.loss,
            "lr": schedule.lr,  # after the scheduler's step, as Megatron logs it
            **self._rates(elapsed),
            "consumed_samples": iteration * batch,
            "global_batch_size": batch,
            "skipped": result.skipped,
            "skipped_total": self.skipped_total,
            "loss_scale": result.loss_scale,  # after the update, as Megatron logs it
            "grad_norm": result.grad_norm,
            "eta_s": eta_seconds(self.records, elapsed, run.training.train_iters - iteration),
            # the kernel that computed core attention on this rank (pinned: the same on a GPU
            # and on the CPU device layer playing it)
            "attention_kernel": kernels_run(run.model.attention_backend,
                                            self.layer_implementation),
            **result.extra,
        }
        if "predicted_iteration_time_s" in record:  # the plan's, on --hardware's profile
            record["predicted_over_measured"] = record["predicted_iteration_time_s"] / elapsed
        self.metrics.write(record)
        self.sinks.training(record)
        self.records.append(record)
        self.interval.add(record, time.perf_counter() - started)
        # Megatron 0.19 prints after the run's first iteration too, without starting a new
        # interval: the next line reports that iteration again
        first = iteration == self.start_iteration + 1
        if iteration % run.logging.log_interval == 0 or first:
            if self.is_logger:
                line = {**record, **self._rates(self.interval.seconds_per_iteration),
                        **self.interval.fields()}
                print(format_log_line(line, run.training.train_iters,
                                      throughput=run.logging.log_throughput), flush=True)
            if not first:
                self.interval.clear()

    def _rates(self, seconds: float) -> dict[str, float]:
        """An iteration's time and the rates it gives: tokens per second and model TFLOP/s
        per GPU (--log-throughput's)."""
        tokens = self.run.tokens_per_iteration
        return {"iter_time_s": seconds, "tokens_per_s": tokens / seconds,
                "tflops_per_gpu": tokens * self.flops_per_token
                / (seconds * 1e12 * self.dist_info.world_size)}

    def evaluate(self, dataset, number: int, iteration: int, where: str, split: str,
                 end: bool = False) -> dict:
        """Evaluation `number` on every rank; the logging rank prints Megatron's block and
        records it (`end`: the one at the end of training)."""
        loss = evaluate(self.step, dataset, number, self.run, self.dist_info.torch_device)
        record = evaluation_record(iteration, split, loss, end)
        self.metrics.write(record)
        self.sinks.evaluation(record, iteration * self.run.training.global_batch_size)
        if self.is_logger:
            print(format_evaluation(where, loss), flush=True)
        return record

    def save(self, iteration: int) -> None:
        run = self.run
        common = {"lr_schedule": self.schedule.state_dict(), "skipped_total": self.skipped_total,
                  "consumed_samples": iteration * run.training.global_batch_size,
                  "args": run.flags(), "tokenizer_json": self.data.tokenizer.to_json(),
                  "padded_vocab_size": self.data.vocab_size,
                  "num_floating_point_operations_so_far":
                      iteration * run.tokens_per_iteration * self.flops_per_token}
        keep_save_directory(self.save_lock, run.checkpointing.save, self.dist_info.rank,
                            self.dist_info.world_size, lambda line: warn(line, self.dist_info))
        if progress_enabled():  # a large model's save takes a while: say it started
            self.log(f"checkpoint iteration {iteration}: saving to {run.checkpointing.save}")
        with INTERRUPT.deferred():  # a checkpoint is committed whole or not begun
            blocked = self.saver.save(iteration, self.step.owned_state(), common)
        self.last_saved = iteration
        self.log(f"checkpoint iteration {iteration}: training blocked {blocked:.3f} s"
                 + (", writing in the background" if run.checkpointing.async_save else ""))

    def close(self) -> None:
        """Release in reverse order of creation; the last save in flight completes."""
        if self.saver is not None:
            self.saver.close()  # a background write's failure surfaces here, in one line
        if self.exits is not None:
            self.exits.close()
        close = getattr(self.step, "close", None)
        if close:
            close()
        if self.metrics is not None:
            self.metrics.close()
        if self.sinks is not None:
            self.sinks.close()


def train(run: RunConfig, dist_info: DistInfo,
          on_step: Callable[[TrainStep], None] | None = None) -> list[dict]:
    """Train `run` in an initialized process group; returns the per-iteration metrics.
    Callable several times in one job (bench/schedules.py runs each schedule);
    `on_step(train_step)` is called once the train step is built."""
    start_time = time.time()
    check_before_start(run, dist_info)
    for line in run_notices(run):
        warn(line, dist_info)
    lock = hold_save_directory(run.checkpointing.save, dist_info.rank, dist_info.world_size,
                               print if dist_info.rank == 0 else (lambda *_: None))
    loop = TrainingLoop(run, dist_info, start_time, lock)
    failed = False
    try:
        loop.set_up(on_step)
        loop.train()
    except BaseException as exc:
        failed = True
        if isinstance(exc, RuntimeError) and timed_out(exc):
            # gloo's traceback says neither who nor what: one line does
            raise waited_too_long(run, dist_info.rank, loop.iteration, exc) from None
        raise
    finally:
        try:
            loop.close()
        except Exception:
            if not failed:  # after a fault, the fault is what the user needs to see
                raise
        finally:
            if lock is not None:
                lock.release()
    return loop.records


def warn(line: str, dist_info: DistInfo) -> None:
    """One line on stderr from rank 0: allowed, but probably not what was meant."""
    if dist_info.rank == 0:
        print(f"pretrain_llama.py: warning: {line}", file=sys.stderr, flush=True)


def eta_seconds(records: list[dict], elapsed: float, remaining: int) -> float:
    """Remaining iterations times the mean iteration time of this run so far, the first
    (warm-up) iteration left out once there are others."""
    times = [r["iter_time_s"] for r in records[1:]] + [elapsed] if records else [elapsed]
    return remaining * sum(times) / len(times)


@contextlib.contextmanager
def setup_phase(name: str, log: Log, enabled: bool = True) -> Iterator[None]:
    """One line per setup phase with its time (the first iteration of a large model waits
    for segment creation and the pipeline's assembly)."""
    if enabled and progress_enabled():  # on a terminal, say what the wait is for
        log(f"setup: {name} ...")
    t0 = time.perf_counter()
    yield
    if enabled:
        log(f"setup: {name} done in {time.perf_counter() - t0:.1f} s")


def configure_automatically(run: RunConfig) -> RunConfig:
    """--auto-config for a training run: the launcher's processes are the GPUs (rank 0
    prints the candidates)."""
    if run.planning.hardware is None:
        raise ConfigError("--hardware", "missing", "--auto-config trains on this machine: "
                          "give its profile (tools/profile_hardware.py --out hw.json)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = run.parallel.procs_per_node or local
    searched = run.evolve(planning={"gpus_per_node": gpus, "nodes": max(1, world // gpus)})
    chosen, found = auto_configure(searched, plan_hardware(searched))
    if os.environ.get("RANK", "0") == "0":
        print(candidates_text(found))
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """pretrain_llama.py: a Ctrl-C anywhere ends in one line (signals.Interrupt)."""
    INTERRUPT.install()
    try:
        return _main(argv)
    except BaseException:
        if not INTERRUPT.received:
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_llama.py: {INTERRUPT.line()}", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_STATUS) from None
    finally:
        INTERRUPT.uninstall()


def _main(argv: Sequence[str] | None) -> int:
    try:  # what every later step reads (the command line's defaults included)
        check_launcher_env()
    except ConfigError as exc:
        exit_bad_input(exc)
    run = parse_args(argv)
    if run.planning.print_model_size:
        print(model_size(run))
        return 0
    if run.planning.plan:
        try:
            return run_plan(run)
        except ConfigError as exc:
            exit_bad_input(exc)
    try:
        if run.planning.auto_config:
            run = configure_automatically(run)
        # before gloo connects (its sockets count) and any thread starts
        check_process_limits(run, int(os.environ.get("WORLD_SIZE", "1")))
        dist_info = initialize_distributed(
            timeout=collective_timeout(run.parallel.distributed_timeout_minutes),
            data_parallel_size=run.data_parallel_size, seed=run.training.seed,
            share_gpu=run.device_checks.share_gpu)
        try:
            train(run, dist_info)
        finally:
            shutdown_distributed()
    except CheckpointWriteError as exc:  # a fault mid-run, met by every rank (collective)
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except (ConfigError, CheckpointError) as exc:
        exit_bad_input(exc)
    except PeerTimeout as exc:  # each rank that waited says what for (not necessarily 0)
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except DiskStateError as exc:  # the drive of --optimizer-nvme-path failed mid-run
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except (SegmentInUseError, ShmSpaceError) as exc:
        # met by the ranks that create segments, not necessarily rank 0: each says it
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RuntimeError as exc:  # last: SegmentInUseError and others are RuntimeErrors
        if peer_gone(exc):  # not this rank's fault: the rank that ended says why
            print(f"pretrain_llama.py: error: rank {os.environ.get('RANK', '0')}: another "
                  "rank of this job is gone (its connection closed); stopping",
                  file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if "can't start new thread" not in str(exc):
            raise
        # past the start-up check: a limit on processes (ulimit -u) or memory
        print(f"pretrain_llama.py: error: a thread could not be started ({exc}): raise "
              "ulimit -v / ulimit -u or free memory", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
