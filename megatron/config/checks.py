"""What makes a run configuration unusable, found before anything is allocated.

`check_run` raises ConfigError for the first inconsistency, naming the flag, the value and
what was expected. It sees the configuration only: checks that need the number of
processes, the file system, the data or a checkpoint run later, where those are known.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from megatron.config.errors import ConfigError, flag_name
from megatron.config.model import MODEL_FIELDS
from megatron.config.tokenizer_names import tokenizer_type_problem
from megatron.config.values import parse_data_path, parse_split

if TYPE_CHECKING:
    from megatron.config.placement import StateStorage
    from megatron.config.run import OptimizationConfig, RunConfig

MAX_SEED = 2**32 - 1  # numpy's RandomState, which megatron-core's dataset indices use
REQUIRED_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size",
                         "num_attention_heads", "seq_length")
FINITE_FIELDS = (("optimization", "lr"), ("optimization", "min_lr"),
                 ("optimization", "lr_warmup_init"),
                 ("optimization", "weight_decay"), ("optimization", "clip_grad"),
                 ("optimization", "adam_beta1"), ("optimization", "adam_beta2"),
                 ("optimization", "adam_eps"), ("precision", "initial_loss_scale"),
                 ("precision", "min_loss_scale"), ("model", "rotary_percent"),
                 ("model", "norm_epsilon"), ("model", "init_method_std"),
                 ("model", "attention_dropout"), ("model", "hidden_dropout"))


def check_run(run: RunConfig) -> None:
    """Raise ConfigError for the first inconsistency of `run`."""
    _check_model(run)
    _check_sizes(run)
    _check_values(run)
    _check_data(run)
    _check_architecture(run)
    _check_optimization(run)
    _check_checkpointing(run)
    _check_parallel(run)
    _check_cpu_optimizer(run)
    _check_profiling(run)


def run_notices(run: RunConfig) -> list[str]:
    """What is allowed but probably not meant, one line each, printed at start."""
    notices = []
    if run.precision.grad_reduce_in_bf16 and run.precision.dtype != "bf16":
        notices.append(f"--grad-reduce-in-bf16 with {run.precision.dtype}: no effect (as in "
                       "Megatron-LM, it applies to --bf16 runs)")
    given, kind = run.model.vocab_size, run.data.tokenizer_type
    if given is not None and run.vocab_size_given is None:
        notices.append(f"--vocab-size {given} with --tokenizer-type {kind}: no effect (as in "
                       "Megatron-LM 0.19, the model's vocabulary is the tokenizer's own, "
                       "padded to a multiple of --make-vocab-size-divisible-by)")
    if run.checkpointing.save is None:
        for field in ("exit_interval", "exit_duration_in_mins"):
            value = getattr(run.exit, field)
            if value is not None:
                notices.append(f"{flag_name(field)} {value} without --save: the run may stop "
                               "early and nothing will be saved")
        if run.exit.exit_signal_handler:
            notices.append(f"--exit-signal-handler without --save: {run.exit.exit_signal} "
                           "stops the run early and nothing will be saved")
        if run.checkpointing.save_interval is not None:
            notices.append(f"--save-interval {run.checkpointing.save_interval} without "
                           "--save: nothing will be saved")
    return notices


def _positive(value: int | None, field: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(flag_name(field), value, "expected a positive integer")


def _check_model(run: RunConfig) -> None:
    for field in REQUIRED_MODEL_FIELDS:
        if getattr(run.model, field) is None:
            raise ConfigError(flag_name(field), "missing", "required (or give --model-preset)")


def _check_sizes(run: RunConfig) -> None:
    for field in MODEL_FIELDS:
        _positive(getattr(run.model, field), field)
    for field in ("kv_channels", "max_position_embeddings", "rotary_base",
                  "make_vocab_size_divisible_by"):
        _positive(getattr(run.model, field), field)
    t = run.training
    for field in ("micro_batch_size", "global_batch_size", "train_iters", "train_samples"):
        _positive(getattr(t, field), field)
    _positive(run.logging.log_interval, "log_interval")
    _positive(run.logging.tensorboard_log_interval, "tensorboard_log_interval")
    _positive(run.logging.tensorboard_queue_size, "tensorboard_queue_size")
    _positive(run.parallel.distributed_timeout_minutes, "distributed_timeout_minutes")
    _positive(run.parallel.pipeline_model_parallel_size, "pipeline_model_parallel_size")
    if not 1 <= t.seed <= MAX_SEED:
        raise ConfigError("--seed", t.seed, f"expected an integer in [1, {MAX_SEED}] "
                          "(Megatron-LM needs a positive seed; numpy, which orders the data, "
                          "one below 2**32)")


def _check_values(run: RunConfig) -> None:
    """Values argparse accepts but training cannot use: non-finite numbers, eps <= 0, and
    the evaluation and exit flags."""
    o, p = run.optimization, run.precision
    for section, field in FINITE_FIELDS:
        value = getattr(getattr(run, section), field)
        if not math.isfinite(value):
            raise ConfigError(flag_name(field), value, "expected a finite number")
    if o.adam_eps <= 0:
        raise ConfigError("--adam-eps", o.adam_eps, "expected a value > 0")
    for field in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        if getattr(p, field) <= 0:
            raise ConfigError(flag_name(field), getattr(p, field), "expected a value > 0")
    if p.loss_scale is not None and not (math.isfinite(p.loss_scale) and p.loss_scale > 0):
        raise ConfigError("--loss-scale", p.loss_scale, "expected a finite value > 0")
    if p.fp16 and p.loss_scale is None and p.min_loss_scale > p.initial_loss_scale:
        # megatron-core's DynamicGradScaler asserts min_scale <= initial_scale
        raise ConfigError("--min-loss-scale", p.min_loss_scale, "must not exceed "
                          f"--initial-loss-scale ({p.initial_loss_scale})")
    m = run.model
    for field in ("norm_epsilon", "init_method_std"):
        if getattr(m, field) <= 0:
            raise ConfigError(flag_name(field), getattr(m, field), "expected a value > 0")
    if not 0.0 < m.rotary_percent <= 1.0:
        raise ConfigError("--rotary-percent", m.rotary_percent, "expected a value in (0, 1]")
    for field in ("attention_dropout", "hidden_dropout"):
        if getattr(m, field) != 0.0:
            raise ConfigError(flag_name(field), getattr(m, field),
                              "not supported: 0 only (LLaMA trains without dropout, and the "
                              "backward stage recomputes on another GPU without the mask)")
    fraction = o.lr_warmup_fraction
    if fraction is not None and not 0.0 <= fraction < 1.0:
        raise ConfigError("--lr-warmup-fraction", fraction, "expected a value in [0, 1) (the "
                          "warmup must end before the decay does)")
    _positive(run.evaluation.eval_interval, "eval_interval")
    _positive(run.exit.exit_interval, "exit_interval")
    if run.evaluation.eval_iters is not None and run.evaluation.eval_iters < 0:
        raise ConfigError("--eval-iters", run.evaluation.eval_iters, "expected an integer >= 0")
    minutes = run.exit.exit_duration_in_mins
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise ConfigError("--exit-duration-in-mins", minutes, "expected a number > 0")


def _check_data(run: RunConfig) -> None:
    d = run.data
    if d.split is not None:
        parse_split(d.split)
    per_split = [d.train_data_path, d.valid_data_path, d.test_data_path]
    if any(path is not None for path in per_split):
        if d.data_path is not None:
            raise ConfigError("--train-data-path", " ".join(d.train_data_path or []),
                              "give either --data-path (with --split) or the per-split "
                              "paths, not both")
        if d.train_data_path is None:
            raise ConfigError("--train-data-path", "missing",
                              "required with --valid-data-path or --test-data-path")
        if d.split is not None:
            raise ConfigError("--split", d.split, "only with --data-path")
    for field in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(d, field) is not None:
            parse_data_path(flag_name(field), getattr(d, field))
    _check_evaluation(run)
    if run.logging.wandb_exp_name is not None and run.logging.wandb_project is None:
        raise ConfigError("--wandb-exp-name", run.logging.wandb_exp_name,
                          "needs --wandb-project")


def _check_evaluation(run: RunConfig) -> None:
    """Evaluation needs a validation set: --eval-iters above 0 (given, or Megatron's
    default where there is one), or --eval-interval given alone."""
    given = run.evaluation
    wanted = run.eval_iters > 0 or (given.eval_interval is not None and given.eval_iters is None)
    if wanted and not run.data.has_validation_set:
        flag = "--eval-interval" if given.eval_interval is not None else "--eval-iters"
        raise ConfigError(flag, getattr(given, flag[2:].replace("-", "_")),
                          "needs a validation set: --split with a validation share "
                          "(e.g. 969,30,1) or --valid-data-path")


def _check_architecture(run: RunConfig) -> None:
    m, t = run.model, run.training
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError("--hidden-size", m.hidden_size,
                          f"must be divisible by --num-attention-heads ({m.num_attention_heads})")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError("--num-attention-heads", m.num_attention_heads,
                          f"must be divisible by --num-query-groups ({m.num_query_groups})")
    rotated = int(m.head_dim * m.rotary_percent)
    if rotated % 2 or rotated == 0:
        flag, value = (("--kv-channels", m.kv_channels) if m.kv_channels else
                       ("--hidden-size", m.hidden_size))
        raise ConfigError(flag, value, f"the rotated channels per head ({rotated}: head width "
                          f"{m.head_dim} x --rotary-percent {m.rotary_percent}) must be even "
                          "and above 0")
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError("--max-position-embeddings", m.max_position_embeddings,
                          f"must be >= --seq-length ({m.seq_length})")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("--global-batch-size", t.global_batch_size,
                          f"must be a multiple of --micro-batch-size ({t.micro_batch_size})")


def _check_optimization(run: RunConfig) -> None:
    o = run.optimization
    for field in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
        if getattr(o, field) < 0:
            raise ConfigError(flag_name(field), getattr(o, field), "expected a value >= 0")
    if o.min_lr > o.lr:
        raise ConfigError("--min-lr", o.min_lr, f"must not exceed --lr ({o.lr})")
    # megatron-core's OptimizerParamScheduler asserts 0 <= init_lr <= max_lr
    if o.lr_warmup_init < 0:
        raise ConfigError("--lr-warmup-init", o.lr_warmup_init, "expected a value >= 0")
    if o.lr_warmup_init > o.lr:
        raise ConfigError("--lr-warmup-init", o.lr_warmup_init, f"must not exceed --lr ({o.lr})")
    for field in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, field) < 1.0:
            raise ConfigError(flag_name(field), getattr(o, field), "expected a value in [0, 1)")
    _check_schedule_flags(o)
    if o.lr_warmup_iters < 0:
        raise ConfigError("--lr-warmup-iters", o.lr_warmup_iters, "expected >= 0")
    if o.lr_warmup_samples < 0:
        raise ConfigError("--lr-warmup-samples", o.lr_warmup_samples, "expected >= 0")
    # megatron-core's scheduler asserts decay > 0 and warmup < decay, whatever the style
    unit = "samples" if run.training.train_samples is not None else "iters"
    _positive(getattr(o, f"lr_decay_{unit}"), f"lr_decay_{unit}")
    warmup = getattr(o, f"lr_warmup_{unit}")
    decay = o.lr_decay_iters if unit == "iters" else run.lr_schedule_steps[2]
    if o.lr_warmup_fraction is None and warmup >= decay:
        # the warmup is the flag given: the decay may be a default (--train-iters/-samples)
        raise ConfigError(f"--lr-warmup-{unit}", warmup, f"must be below the decay's {decay} "
                          f"(--lr-decay-{unit}, by default --train-{unit})")
    if o.lr_decay_style == "WSD" and run.lr_schedule_steps[3] is None:
        raise ConfigError("--lr-decay-style", "WSD", "needs --lr-wsd-decay-iters (or "
                          "--lr-wsd-decay-samples with --train-samples)")


def _check_schedule_flags(o: OptimizationConfig) -> None:
    """Megatron-LM's checks of the weight-decay increment and of the scheduler on resume."""
    given = [f for f in ("start_weight_decay", "end_weight_decay") if getattr(o, f) is not None]
    if o.weight_decay_incr_style == "constant" and given:
        raise ConfigError(flag_name(given[0]), getattr(o, given[0]), "needs "
                          "--weight-decay-incr-style linear or cosine (constant: --weight-decay)")
    if o.weight_decay_incr_style != "constant" and len(given) < 2:
        raise ConfigError("--weight-decay-incr-style", o.weight_decay_incr_style,
                          "needs --start-weight-decay and --end-weight-decay")
    for field in given:
        if not math.isfinite(getattr(o, field)) or getattr(o, field) < 0:
            raise ConfigError(flag_name(field), getattr(o, field), "expected a value >= 0")
    if len(given) == 2 and o.end_weight_decay < o.start_weight_decay:
        # megatron-core's scheduler asserts end_wd >= start_wd: the decay only increases
        raise ConfigError("--end-weight-decay", o.end_weight_decay,
                          f"must not be below --start-weight-decay ({o.start_weight_decay})")
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler", True, "give one of it and "
                          "--use-checkpoint-opt_param-scheduler")


def _check_checkpointing(run: RunConfig) -> None:
    c = run.checkpointing
    # without --save, --save-interval saves nothing (Megatron-LM 0.19 saves only `if
    # args.save and args.save_interval`, and a signal ends its run without a checkpoint)
    _positive(c.save_interval, "save_interval")
    if c.finetune and c.load is None:
        raise ConfigError("--finetune", True, "needs --load DIR")
    _check_tokenizer(run)
    if c.ckpt_format != "torch_dist":
        raise ConfigError("--ckpt-format", c.ckpt_format,
                          "expected torch_dist (megatron-core's dist_checkpointing), the "
                          "only format supported")
    inject = run.testing.inject_overflow
    if inject is not None and len(inject) != 3:
        raise ConfigError("--inject-overflow", list(inject), "expected ITER,STAGE,SUB")


def _check_tokenizer(run: RunConfig) -> None:
    """The tokenizer flags that need no file system (the files are read by the data layer)."""
    d = run.data
    if d.mock_data and (d.data_path or d.train_data_path):
        raise ConfigError("--mock-data", True, "synthetic data replaces --data-path: give one")
    if d.tokenizer_type is None:
        if d.data_path is not None and d.tokenizer_model is None:
            raise ConfigError("--tokenizer-model", "missing",
                              "required with --data-path (or give --tokenizer-type)")
        return
    problem = tokenizer_type_problem(d.tokenizer_type)
    if problem:
        raise ConfigError("--tokenizer-type", d.tokenizer_type, problem)
    if d.data_path is None and d.train_data_path is None and not d.mock_data:
        raise ConfigError("--tokenizer-type", d.tokenizer_type, "needs --data-path or "
                          "--mock-data (the built-in demo corpus has its own tokenizer)")
    if d.tokenizer_type == "NullTokenizer" and run.model.vocab_size is None:
        raise ConfigError("--vocab-size", "missing", "NullTokenizer needs --vocab-size N "
                          "(ids 0..N-1 given in the data, N-1 the end of document)")


def _check_parallel(run: RunConfig) -> None:
    """The parallel layout (the world size is checked at start-up)."""
    p, t = run.parallel, run.training
    _positive(p.procs_per_node, "procs_per_node")
    d = p.data_parallel_size
    if d <= 0:
        raise ConfigError("--data-parallel-size", d, "expected a positive integer")
    if p.zero_stage not in (0, 1, 2):
        raise ConfigError("--zero-stage", p.zero_stage, "expected 0, 1 or 2")
    if t.global_batch_size % (t.micro_batch_size * d):
        raise ConfigError("--global-batch-size", t.global_batch_size,
                          f"must be a multiple of --micro-batch-size x --data-parallel-size "
                          f"({t.micro_batch_size} x {d})")
    if d > 1 and p.procs_per_node is not None and p.procs_per_node % d:
        raise ConfigError("--procs-per-node", p.procs_per_node,
                          f"expected a multiple of --data-parallel-size ({d}): the "
                          "replicas of a pipeline rank share a node's segments")
    for field in ("nodes", "gpus_per_node"):
        _positive(getattr(run.planning, field), field)


def _check_cpu_optimizer(run: RunConfig) -> None:
    c = run.cpu_optimizer
    _positive(c.cpu_optimizer_threads, "cpu_optimizer_threads")
    # the placement's flags are read and checked once, here (megatron/config/placement.py)
    _check_nvme(run, c.placement.states)
    p = run.precision
    for field in ("optimizer_state_dtype", "master_dtype"):
        if getattr(p, field) != "fp32" and run.parallel.one_process:
            raise ConfigError(flag_name(field), getattr(p, field),
                              "fp32 with --pipeline-schedule single (the one-process "
                              "reference keeps torch's fp32 AdamW); bf16 needs the CPU "
                              "optimizer: give a pipeline schedule")


def _check_nvme(run: RunConfig, states: StateStorage) -> None:
    """What the NVMe tier needs of the run and the drive (the placement checked its flags;
    the free space is checked once the state sizes are known)."""
    if not states.on_nvme:
        return
    path = states.nvme_path
    if run.parallel.one_process:
        raise ConfigError("--optimizer-state-location", "nvme",
                          "host with --pipeline-schedule single (the one-process reference "
                          "keeps torch's AdamW in memory); NVMe states need a pipeline")
    if path is None:
        if run.planning.plan or run.planning.print_model_size:
            return  # a plan needs no drive here: the profile describes the node's
        raise ConfigError("--optimizer-nvme-path", None,
                          "a directory on a local drive with --optimizer-state-location nvme")
    if not os.path.exists(path):
        raise ConfigError("--optimizer-nvme-path", path, "an existing directory")
    if not os.path.isdir(path):
        raise ConfigError("--optimizer-nvme-path", path, "a directory, not a file")
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:  # a probe, not os.access: the error says why (read-only file system, permission)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("--optimizer-nvme-path", path,
                          f"a directory this user can write ({exc.strerror})") from None


def _check_profiling(run: RunConfig) -> None:
    p = run.profiling
    if not p.profile:
        return
    _positive(p.profile_step_start, "profile_step_start")
    if p.profile_step_end <= p.profile_step_start:
        raise ConfigError("--profile-step-end", p.profile_step_end,
                          f"more than --profile-step-start ({p.profile_step_start})")
    if p.use_pytorch_profiler and run.logging.tensorboard_dir is None:
        raise ConfigError("--use-pytorch-profiler", "no --tensorboard-dir",
                          "a --tensorboard-dir to write the trace to, as Megatron")
