"""One run's configuration: frozen, typed, in sections, valid once it exists.

The command line (megatron/training/arguments.py) fills it from Megatron-LM's flags, a
model preset and the built-in defaults; everything below reads it and nothing below sees
argparse. Each field carries the name of its flag (`optimization.lr` is `--lr`), so a
configuration converts to the flags' values and back without a table. Quantities derived
from several fields (micro-batches per iteration, tokens per iteration, samples per data
split) are properties here and nowhere else.

Constructing a RunConfig validates it (megatron/config/checks.py): a configuration that
exists is one the run can use, and `evolve` (the planner's way to try another shape) is
checked the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from megatron.config.checks import check_run
from megatron.config.model import ModelConfig
from megatron.config.placement import Placement
from megatron.config.values import parse_split

# Bytes per element of the precisions a flag can name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def host_gradient_dtype(working_dtype: str, grad_reduce_in_bf16: bool = False,
                        accumulate_allreduce_grads_in_fp32: bool = False) -> str:
    """The dtype of the main gradients: what the micro-batches' gradients are summed in on
    the device, offloaded to the host in, reduced across data-parallel replicas in and read
    by the CPU optimizer in. Megatron-LM 0.19's rule, on every device: a bf16 run sums in
    fp32 unless --grad-reduce-in-bf16 (which wins over the other flag, as there); an fp16
    run in fp16 unless --accumulate-allreduce-grads-in-fp32 (--grad-reduce-in-bf16 has no
    effect on it, as there); an fp32 run in fp32. The one rule the device's sums, the
    offload, the one-process reference, the memory plans and the fit check follow."""
    if working_dtype == "bf16":
        return "bf16" if grad_reduce_in_bf16 else "fp32"
    if working_dtype == "fp16" and not accumulate_allreduce_grads_in_fp32:
        return "fp16"
    return "fp32"


CUSTOM_MODEL = "custom"
DEFAULT_EVAL_ITERS = 100  # Megatron's


def optimizer_state_bytes(master_bytes: int, moment_bytes: int) -> int:
    """Host bytes per parameter of the optimizer state: the master and Adam's two moments."""
    return master_bytes + 2 * moment_bytes


@dataclass(frozen=True)
class TrainingConfig:
    """How much to train on: batches and iterations."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int  # with --train-samples: samples // global batch
    train_samples: int | None  # sample-based training (the LR schedule counts samples)
    seed: int


@dataclass(frozen=True)
class OptimizationConfig:
    """AdamW, clipping and the learning-rate schedule (megatron-core's scheduler), in
    iterations or, with --train-samples, in samples (RunConfig.lr_schedule_steps)."""

    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_warmup_samples: int
    lr_warmup_fraction: float | None  # of the decay, instead of iterations or samples
    lr_decay_iters: int
    lr_decay_samples: int | None  # None: --train-samples
    lr_decay_style: str
    lr_wsd_decay_style: str
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_samples: int | None
    weight_decay: float
    clip_grad: float  # 0 disables clipping by the global norm
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    lr_warmup_init: float = 0.0  # the learning rate the warmup starts from
    # weight decay from start to end over the training (Megatron's; constant: --weight-decay)
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    # on resume, the LR schedule of this run's flags instead of the checkpoint's
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint's (the default here)


@dataclass(frozen=True)
class PrecisionConfig:
    """The working precision of parameters, gradients and messages, the loss scaling of
    fp16, and the precision of the optimizer state in host memory."""

    bf16: bool
    fp16: bool
    loss_scale: float | None  # fp16: a static scale instead of the dynamic one
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int  # overflows in a row before the dynamic scale backs off
    optimizer_state_dtype: str  # Adam's m and v: fp32 or bf16
    master_dtype: str  # the master weights: fp32 or bf16
    master_rounding: str  # a bf16 master: stochastic or nearest
    # the main gradients' dtype (host_gradient_dtype): Megatron-LM's two flags
    grad_reduce_in_bf16: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False

    @property
    def dtype(self) -> str:
        """fp32, bf16 or fp16."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def working_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def host_gradient_dtype(self) -> str:
        """The main gradients' dtype (see host_gradient_dtype)."""
        return host_gradient_dtype(self.dtype, self.grad_reduce_in_bf16,
                                   self.accumulate_allreduce_grads_in_fp32)

    @property
    def host_gradient_bytes(self) -> int:
        return DTYPE_BYTES[self.host_gradient_dtype]

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Host bytes per parameter of the master and Adam's two moments (12, 10, 8 or 6)."""
        return optimizer_state_bytes(DTYPE_BYTES[self.master_dtype],
                                     DTYPE_BYTES[self.optimizer_state_dtype])


@dataclass(frozen=True)
class CpuOptimizerConfig:
    """The host optimizer of a pipeline, and the share of its updates the device takes."""

    cpu_optimizer_threads: int | None  # None: this process's share of the usable cores
    # every K-th subgroup on the device; -N (device:N): all but every N-th; None: Eq. 1; 0: none
    optimizer_gpu_stride: int | None
    optimizer_subgroup_size: int | None  # None: from the largest owned stage
    optimizer_gpu_resident_fraction: float  # > 0: the static (Twin-Flow) split instead
    # Where master, m and v live: "host" memory, or files on an NVMe drive under
    # optimizer_nvme_path with a window of them in host memory.
    optimizer_state_location: str = "host"
    optimizer_nvme_path: str | None = None
    # Host memory: snapshot each step so rollbacks and clipping corrections are bit-exact
    # (NVMe states are exact anyway: the file keeps the committed version).
    optimizer_exact_rollback: bool = False

    @cached_property
    def placement(self) -> Placement:
        """These flags as one value, read (and checked) once per configuration."""
        return Placement.of(self)


@dataclass(frozen=True)
class DataConfig:
    """What to train on (Megatron's data flags) and where derived data is cached."""

    data_path: tuple[str, ...] | None  # PREFIX... or WEIGHT PREFIX ...; None: the demo corpus
    split: str | None  # TRAIN,VALID,TEST weights of --data-path's documents
    train_data_path: tuple[str, ...] | None
    valid_data_path: tuple[str, ...] | None
    test_data_path: tuple[str, ...] | None
    tokenizer_model: str | None  # None: the demo corpus's tokenizer
    tokenizer_type: str | None  # Megatron's --tokenizer-type; None: a tokenizer JSON
    vocab_file: str | None  # GPT2BPETokenizer's vocab.json
    merge_file: str | None  # GPT2BPETokenizer's merges.txt
    data_cache_dir: str  # the demo corpus and dataset indices
    mock_data: bool  # megatron-core's MockGPTDataset (its own even split) instead of files

    @property
    def has_validation_set(self) -> bool:
        return self.mock_data or self.valid_data_path is not None or (
            self.split is not None and parse_split(self.split)[1] > 0)


@dataclass(frozen=True)
class EvaluationConfig:
    """As given; RunConfig.eval_interval and eval_iters resolve Megatron's defaults."""

    eval_interval: int | None  # None: evaluate only at the end of training (Megatron)
    eval_iters: int | None  # None: 100 with a validation set, else 0; 0: no evaluation


# --pipeline-schedule's one-process reference: the whole model and torch's AdamW in one
# process, no pipeline schedule (the schedules themselves are megatron/schedules' registry)
ONE_PROCESS_SCHEDULE = "single"


@dataclass(frozen=True)
class ParallelConfig:
    """The pipeline's shape and its data-parallel replicas."""

    pipeline_schedule: str | None  # None: single with one process, decoupled with several
    pipeline_model_parallel_size: int | None  # None: the processes started
    data_parallel_size: int
    zero_stage: int
    forward_stages: int | None  # None: the schedule's default
    backward_split: int | None
    stage_layers: tuple[int, ...] | None  # None: balanced by cost
    procs_per_node: int | None  # None: the launcher's LOCAL_WORLD_SIZE
    schedule_file: str | None
    distributed_timeout_minutes: int

    @property
    def one_process(self) -> bool:
        """--pipeline-schedule single: the one-process reference was asked for."""
        return self.pipeline_schedule == ONE_PROCESS_SCHEDULE

    @property
    def names_pipeline_schedule(self) -> bool:
        """--pipeline-schedule names a pipeline schedule (not single, not left out)."""
        return self.pipeline_schedule not in (None, ONE_PROCESS_SCHEDULE)


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    save_interval: int | None
    load: str | None
    load_optional: bool
    finetune: bool
    async_save: bool
    ckpt_format: str = "torch_dist"
    no_load_optim: bool = False
    no_load_rng: bool = False
    exit_on_missing_checkpoint: bool = False
    use_checkpoint_args: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    log_throughput: bool  # tokens/s and TFLOP/s per GPU in the iteration line
    log_timers_to_tensorboard: bool
    metrics_file: str | None
    tensorboard_dir: str | None
    wandb_project: str | None
    wandb_exp_name: str | None
    timeline: str | None  # PNG of the measured last iteration
    trace: str | None  # Chrome trace of the measured last iteration
    tensorboard_log_interval: int = 1  # TensorBoard and W&B scalars every N iterations
    tensorboard_queue_size: int = 1000  # events the TensorBoard writer queues
    wandb_save_dir: str | None = None  # None: --save's wandb/ (Megatron's), else W&B's own
    wandb_entity: str | None = None


@dataclass(frozen=True)
class ExitConfig:
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    exit_signal: str  # the signal's name (SIGTERM)


@dataclass(frozen=True)
class PlanningConfig:
    """What to print instead of training, and the machine to plan for."""

    print_model_size: bool
    plan: bool
    auto_config: bool
    json: bool
    nodes: int | None  # None: 1
    gpus_per_node: int | None  # None: the hardware profile's
    hardware: str | None  # a built-in profile or a JSON file; None: the default profile


@dataclass(frozen=True)
class TestingConfig:
    """Aids for tests: checked messages and an injected overflow."""

    p2p_check: bool
    inject_overflow: tuple[int, int, int] | None  # (iteration, stage, sub)


@dataclass(frozen=True)
class DeviceCheckConfig:
    """Checks of the device layer's stream order (docs/device-sanitizer.md) and the test
    mode in which ranks share a GPU."""

    device_sanitizer: bool  # every cross-stream access checked against the declared order
    device_chaos: int | None  # a seed: copy streams delayed by seeded random amounts
    share_gpu: bool = False  # several local ranks on one GPU, over gloo (a test mode)


@dataclass(frozen=True)
class ProfilingConfig:
    """Megatron's profiling flags (megatron/training/profiling.py)."""

    profile: bool
    use_pytorch_profiler: bool
    profile_step_start: int  # the first iteration profiled
    profile_step_end: int  # the first iteration after them
    profile_ranks: tuple[int, ...]  # empty: every rank (Megatron's default)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    training: TrainingConfig
    optimization: OptimizationConfig
    precision: PrecisionConfig
    cpu_optimizer: CpuOptimizerConfig
    data: DataConfig
    evaluation: EvaluationConfig
    parallel: ParallelConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    exit: ExitConfig
    planning: PlanningConfig
    testing: TestingConfig
    device_checks: DeviceCheckConfig
    profiling: ProfilingConfig

    def __post_init__(self) -> None:
        check_run(self)

    # --- derived quantities ------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline (data-parallel replica) runs per iteration."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)

    @property
    def tokens_per_iteration(self) -> int:
        return self.training.global_batch_size * self.model.seq_length

    @property
    def vocab_size_given(self) -> int | None:
        """--vocab-size where it decides the model's vocabulary (before padding), as in
        Megatron-LM 0.19: NullTokenizer's own size; without --tokenizer-type (this
        project's tokenizer JSON, or no tokenizer read: --plan) the model's, as Megatron's
        model built without a tokenizer. None with the tokenizers that know their
        vocabulary (HuggingFace, SentencePiece, GPT-2 BPE): 0.19 gives them no vocab_size
        and pads their own, so the flag has no effect there."""
        if self.data.tokenizer_type not in (None, "NullTokenizer"):
            return None
        return self.model.vocab_size

    @property
    def eval_interval(self) -> int | None:
        """--eval-interval; None (Megatron's default): only the evaluation at the end."""
        return self.evaluation.eval_interval

    @property
    def eval_iters(self) -> int:
        """--eval-iters, or Megatron's 100 where there is a validation set (--split with a
        validation share, or --valid-data-path) and 0 (no evaluation) where there is none."""
        given = self.evaluation.eval_iters
        if given is not None:
            return given
        return DEFAULT_EVAL_ITERS if self.data.has_validation_set else 0

    @property
    def evaluations(self) -> int:
        """Evaluations a run makes: one per interval, plus the one at the end."""
        if self.eval_iters == 0:
            return 0
        interval = self.eval_interval
        return (self.training.train_iters // interval if interval else 0) + 1

    @property
    def lr_schedule_steps(self) -> tuple[int, float, int, int | None]:
        """megatron-core's scheduler in Megatron's units, samples: (samples per iteration,
        warmup, decay, WSD decay). Iteration-based flags count global batches."""
        t, o = self.training, self.optimization
        batch = t.global_batch_size
        if t.train_samples is not None:
            decay = t.train_samples if o.lr_decay_samples is None else o.lr_decay_samples
            warmup = o.lr_warmup_samples
            wsd = o.lr_wsd_decay_samples
        else:
            decay = o.lr_decay_iters * batch
            warmup = o.lr_warmup_iters * batch
            wsd = None if o.lr_wsd_decay_iters is None else o.lr_wsd_decay_iters * batch
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        return batch, warmup, decay, wsd

    @property
    def training_samples(self) -> int:
        """The samples the training reads, as Megatron-LM counts them: --train-samples, or
        --train-iters times the global batch. Its scheduler's weight-decay increment spans
        them, and megatron-core's training sample order depends on them."""
        t = self.training
        if t.train_samples is not None:
            return t.train_samples
        return t.train_iters * t.global_batch_size

    @property
    def split_sizes(self) -> list[int]:
        """Samples each data split must provide (Megatron's formula): training_samples for
        training, evaluations x eval_iters x global batch for validation (every evaluation
        reads new batches), eval_iters x global batch for the test set."""
        batch, iters = self.training.global_batch_size, self.eval_iters
        return [self.training_samples, self.evaluations * iters * batch, iters * batch]

    # --- conversions -------------------------------------------------------------------

    def evolve(self, **sections: Mapping[str, Any]) -> RunConfig:
        """This configuration with some fields of some sections changed (and checked):
        `run.evolve(parallel={"forward_stages": 8}, training={"micro_batch_size": 2})`."""
        return replace(self, **{name: replace(getattr(self, name), **changes)
                                for name, changes in sections.items()})

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> RunConfig:
        """From every flag's value by its argparse name (`lr_warmup_iters`); lists become
        tuples, --model-preset names the model section."""
        sections = {}
        for section in fields(cls):
            kind = _SECTION_TYPES[section.name]
            found = {f.name: _frozen(values[_flag_of(section.name, f.name)])
                     for f in fields(kind)}
            if section.name == "model":
                found["name"] = found["name"] or CUSTOM_MODEL
            sections[section.name] = kind(**found)
        return cls(**sections)

    def flags(self) -> dict[str, Any]:
        """Every flag's value by its argparse name: what from_flags reads, what checkpoints
        record and W&B shows."""
        out: dict[str, Any] = {}
        for section in fields(self):
            part = getattr(self, section.name)
            for f in fields(part):
                value = getattr(part, f.name)
                out[_flag_of(section.name, f.name)] = list(value) if isinstance(value, tuple) \
                    else value
        if out["model_preset"] == CUSTOM_MODEL:
            out["model_preset"] = None
        return out


_SECTION_TYPES = {"model": ModelConfig, "training": TrainingConfig,
                  "optimization": OptimizationConfig, "precision": PrecisionConfig,
                  "cpu_optimizer": CpuOptimizerConfig, "data": DataConfig,
                  "evaluation": EvaluationConfig, "parallel": ParallelConfig,
                  "checkpointing": CheckpointConfig, "logging": LoggingConfig,
                  "exit": ExitConfig, "planning": PlanningConfig, "testing": TestingConfig,
                  "device_checks": DeviceCheckConfig, "profiling": ProfilingConfig}


def _flag_of(section: str, field: str) -> str:
    """The argparse name of a field: its own, but the model's name is --model-preset."""
    return "model_preset" if (section, field) == ("model", "name") else field


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
