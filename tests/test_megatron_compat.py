"""A Megatron-LM user's launch, unchanged: Megatron's flags, parsing, defaults and layout."""

import json
import math
import os
import subprocess
import types

import pytest
import torch

from megatron.common.ports import reserved_port
from megatron.training.arguments import build_parser, parse_args
from megatron.training.lr_schedule import LRSchedule
from tests import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--seq-length", "32"]

# The flags of Megatron-LM 0.16's examples/llama/train_llama3_8b_h100_fp8.sh and of
# docs/llama_mistral.md's LLaMA-2/3 training arguments, at CPU sizes, bf16 for fp8.
MEGATRON_LLAMA_LAUNCH = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "160", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
    "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--rotary-base", "500000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
    "--attention-backend", "fused", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
    "--use-rotary-position-embeddings", "--no-position-embedding",
    "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
    "--transformer-impl", "transformer_engine", "--make-vocab-size-divisible-by", "128",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "40",
    "--lr-decay-samples", "36", "--lr-warmup-samples", "4", "--lr", "0.00015",
    "--min-lr", "0.00001", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
    "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
    "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
    "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--tiktoken-pattern", "v2",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000", "--save", "ckpt",
    "--load", "ckpt",
    "--log-throughput", "--distributed-timeout-minutes", "60", "--recompute-granularity",
    "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--distributed-backend", "nccl", "--optimizer", "adam", "--seed", "1234",
    "--log-timers-to-tensorboard", "--exit-signal-handler", "--exit-signal", "SIGUSR1",
    "--ckpt-format", "torch_dist", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--mock-data", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
]


def refused(capsys, argv):
    """(exit status, the lines on stderr) of parse_args(argv)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    return exc.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.unit
def test_megatrons_llama_launch_is_accepted_and_its_values_honoured():
    run = parse_args(MEGATRON_LLAMA_LAUNCH)
    m = run.model
    assert (m.rotary_base, m.kv_channels, m.norm_epsilon, m.init_method_std) == (
        500000, 16, 1e-5, 0.0134)
    assert (m.num_query_groups, m.max_position_embeddings) == (2, 64)
    assert run.training.train_iters == 10  # 40 samples / global batch 4
    assert run.lr_schedule_steps == (4, 4, 36, None)  # Megatron's units: samples
    assert run.precision.bf16 and run.exit.exit_signal == "SIGUSR1"
    assert run.precision.host_gradient_dtype == "bf16"  # --grad-reduce-in-bf16
    assert run.parallel.distributed_timeout_minutes == 60
    assert run.logging.log_throughput and run.logging.log_timers_to_tensorboard


@pytest.mark.unit
def test_no_prefix_matching_and_loss_scale_is_the_loss_scale(capsys):
    run = parse_args([*SMALL, "--fp16", "--loss-scale", "1"])
    assert run.precision.loss_scale == 1.0 and run.precision.loss_scale_window == 1000
    from megatron.pipeline.config import LossScaling

    scaler = LossScaling.of(run.precision).build()  # what both train steps use
    for overflow in (False, True, True, False):
        scaler.update(overflow)
        assert scaler.scale == 1.0  # static: neither grows nor backs off
    code, lines = refused(capsys, [*SMALL, "--num-layer", "2", "--hiden-size", "8"])
    assert code == 2 and len(lines) == 1
    assert "--num-layer (did you mean --num-layers?)" in lines[0]
    assert "--hiden-size (did you mean --hidden-size?)" in lines[0]
    assert "usage" not in lines[0]


@pytest.mark.unit
def test_a_megatron_flag_this_design_lacks_is_refused_as_such_not_as_a_typo(capsys):
    """Megatron-LM 0.19 flags pretrain_llama.py does not implement: one line that names each
    as a Megatron-LM flag not supported here, apart from the typos beside them."""
    code, lines = refused(capsys, [*SMALL, "--log-params-norm", "--log-num-zeros-in-grad",
                                   "--num-layer", "2"])
    assert code == 2 and len(lines) == 1, lines
    typos, _, megatron = lines[0].partition("; also ")
    assert "--num-layer (did you mean --num-layers?)" in typos and "--log-params-norm" not in typos
    assert megatron.startswith("Megatron-LM 0.19 flags --log-params-norm, --log-num-zeros-in-grad: "
                               "not supported by this design")
    code, lines = refused(capsys, [*SMALL, "--deterministic-mode"])
    assert lines == ["pretrain_llama.py: error: Megatron-LM 0.19 flag --deterministic-mode: "
                     "not supported by this design (--help lists the flags it takes): drop it"]


@pytest.mark.unit
@pytest.mark.parametrize("flags,named,says", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size", "tensor parallel"),
    (["--context-parallel-size", "2"], "--context-parallel-size", "context parallel"),
    (["--normalization", "LayerNorm"], "--normalization", "RMSNorm"),
    (["--position-embedding-type", "learned_absolute"], "--position-embedding-type", "rope"),
    (["--recompute-granularity", "selective"], "--recompute-granularity", "full"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p", "not supported"),
    (["--use-legacy-models"], "--use-legacy-models", "megatron-core"),
    (["--fp8-format", "hybrid"], "--fp8-format", "--bf16"),
    (["--rampup-batch-size", "16", "16", "5859375"], "--rampup-batch-size 16 16 5859375",
     "constant --global-batch-size"),
    (["--optimizer", "sgd"], "--optimizer", "adam"),
    (["--empty-unused-memory-level", "3"], "--empty-unused-memory-level", "0, 1, 2"),
    (["--optimizer", "lion"], "--optimizer", "AdamW"),  # 0.19's newer choices: the same why
    (["--position-embedding-type", "yarn"], "--position-embedding-type", "rotary"),
    # flags of Megatron-LM 0.19 launch scripts that change the numbers: refused with the why
    (["--recompute-activations"], "--recompute-activations", "whole layers"),
    (["--eod-mask-loss"], "--eod-mask-loss", "every token's loss"),
    (["--reset-position-ids"], "--reset-position-ids", "across documents"),
    (["--qk-layernorm"], "--qk-layernorm", "LLaMA"),
    (["--squared-relu"], "--squared-relu", "SwiGLU"),
    (["--use-rope-scaling"], "--use-rope-scaling", "--rotary-base"),
    (["--no-save-optim"], "--no-save-optim", "exact"),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "--num-layers-per-virtual-pipeline-stage",
     "--pipeline-schedule"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout", "0 only"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl", "local"),
    (["--max-position-embeddings", "16"], "--max-position-embeddings", ">= --seq-length"),
    (["--train-samples", "40", "--train-iters", "5"], "--train-iters", "not with --train-samples"),
    (["--lr-decay-samples", "40"], "--lr-decay-samples", "needs --train-samples"),
    (["--exit-signal", "SIGKILL"], "--exit-signal", "can be caught"),
    (["--lr", "fast"], "--lr", "float"),
])
def test_what_the_design_cannot_honour_is_refused_in_one_line(capsys, flags, named, says):
    code, lines = refused(capsys, [*SMALL, *flags])
    assert code == 2 and len(lines) == 1, lines
    assert named in lines[0] and says in lines[0]


@pytest.mark.unit
def test_without_a_preset_the_defaults_are_megatrons():
    run = parse_args(SMALL)
    o, p = run.optimization, run.precision
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (0.9, 0.999, 1e-8, 0.01)
    assert (o.lr_decay_style, o.clip_grad, o.min_lr, o.lr_warmup_iters) == ("linear", 1.0, 0, 0)
    assert (p.initial_loss_scale, p.min_loss_scale, p.loss_scale_window, p.hysteresis) == (
        2.0**32, 1.0, 1000, 2)
    assert (run.logging.log_interval, run.checkpointing.async_save) == (100, False)
    assert (run.model.rotary_base, run.model.norm_epsilon, run.model.init_method_std) == (
        10000, 1e-5, 0.02)
    assert run.model.padded_vocab_size(50257) == 50304  # GPT-2's, as Megatron pads it
    assert run.exit.exit_signal == "SIGTERM"
    wide = parse_args(["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads",
                       "32", "--seq-length", "64"])
    assert wide.model.ffn_hidden_size == 10880  # Megatron's SwiGLU width for hidden 4096
    with_data = parse_args([*SMALL, "--data-path", "corpus_text_document",
                            "--tokenizer-model", "tok.json"])
    assert with_data.data.split == "969,30,1" and with_data.eval_iters == 100
    assert with_data.evaluations == 1  # no --eval-interval: only at the end
    preset = parse_args(["--model-preset", "tiny"])  # LLaMA-2's recipe comes with a preset
    assert (preset.optimization.adam_beta2, preset.optimization.weight_decay) == (0.95, 0.1)


@pytest.mark.unit
def test_query_groups_take_effect_with_megatrons_switch_and_are_refused_without(capsys):
    """Megatron-LM builds grouped-query attention only with --group-query-attention (a
    group count alone is ignored there: multi-head attention); here the switch builds it,
    as there, the count alone is refused in one line rather than read either way, and a
    count equal to the heads (multi-head either way) needs no switch."""
    with_switch = parse_args([*SMALL, "--group-query-attention", "--num-query-groups", "2"])
    assert with_switch.model.num_query_groups == 2
    assert parse_args([*SMALL, "--group-query-attention"]).model.num_query_groups == 1
    assert parse_args([*SMALL, "--num-query-groups", "4"]).model.num_query_groups == 4
    assert parse_args(SMALL).model.num_query_groups == 4
    code, lines = refused(capsys, [*SMALL, "--num-query-groups", "2"])
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("pretrain_llama.py: error: --num-query-groups 2: needs "
                               "--group-query-attention")


@pytest.mark.unit
@pytest.mark.parametrize("flags", [
    ["--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1"],
    ["--train-samples", "40", "--lr-warmup-iters", "0"],
    ["--train-samples", "40", "--lr-warmup-samples", "0", "--lr-warmup-fraction", "0.1"],
    ["--train-iters", "10", "--lr-warmup-samples", "0"],
])
def test_a_warmup_of_zero_is_megatrons_default_not_a_second_warmup(flags):
    """Megatron-LM 0.19 checks the other unit's warmup against its default 0 (asserts
    lr_warmup_iters == 0), so a launch that spells the 0 out is accepted."""
    run = parse_args([*SMALL, *flags])
    fraction = "--lr-warmup-fraction" in flags
    assert run.optimization.lr_warmup_fraction == (0.1 if fraction else None)
    assert (run.optimization.lr_warmup_iters, run.optimization.lr_warmup_samples) == (0, 0)


@pytest.mark.unit
def test_checkpoint_io_and_timer_tuning_of_megatron_lm_0_19_is_accepted():
    """Flags of Megatron's launch scripts that tune how a torch_dist checkpoint is written
    or read, not what it holds, or Megatron's own timers; validation perplexity is always
    written."""
    run = parse_args([*SMALL, "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                      "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure",
                      "--auto-detect-ckpt-format", "--timing-log-level", "2",
                      "--timing-log-option", "all", "--log-validation-ppl-to-tensorboard"])
    assert run.flags() == parse_args(SMALL).flags()


@pytest.mark.unit
def test_profile_ranks_are_megatrons_list_and_default_to_every_rank():
    """Megatron-LM 0.19: --profile-ranks 0 1 (nargs +); left out, every rank profiles."""
    from megatron.training.profiling import IterationProfiler

    profile = [*SMALL, "--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"]
    run = parse_args([*profile, "--profile-ranks", "0", "2"])
    assert run.profiling.profile_ranks == (0, 2)
    chosen = [IterationProfiler(run, rank)._torch for rank in range(3)]
    assert chosen == [True, False, True]
    every = parse_args(profile)
    assert all(IterationProfiler(every, rank)._torch for rank in range(3))


@pytest.mark.unit
def test_help_is_one_line_per_flag(capsys):
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings]
    assert all(a.help for a in flags)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out.splitlines()
    for action in flags:
        lines = [line for line in out
                 if line.split(" ")[2:3] == [action.option_strings[0]]
                 or line.startswith(f"  {action.option_strings[0]},")]
        assert len(lines) == 1, action.option_strings
        following = out[out.index(lines[0]) + 1] if out.index(lines[0]) + 1 < len(out) else ""
        assert not following.startswith("    "), action.option_strings  # nothing wrapped


@pytest.mark.unit
@pytest.mark.parametrize("world,flags,replicas", [
    ("4", ["--pipeline-model-parallel-size", "2"], 2),
    ("2", ["--pipeline-model-parallel-size", "1"], 2),
    ("2", [], 1),  # without the flag: one pipeline of every process
    ("4", ["--data-parallel-size", "2"], 2),
])
def test_world_size_is_pipeline_times_data_parallel(monkeypatch, world, flags, replicas):
    monkeypatch.setenv("WORLD_SIZE", world)
    run = parse_args([*SMALL, "--micro-batch-size", "1", *flags])
    assert run.data_parallel_size == replicas
    assert run.training.global_batch_size == replicas  # Megatron: micro-batch x replicas


@pytest.mark.unit
def test_a_pipeline_size_that_does_not_divide_the_world_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, lines = refused(capsys, [*SMALL, "--pipeline-model-parallel-size", "2"])
    assert code == 2 and len(lines) == 1 and "3 processes" in lines[0]


@pytest.mark.unit
def test_sample_based_schedule_equals_the_iteration_based_one():
    """Megatron counts the schedule in samples: --train-samples with warmup and decay in
    samples gives the iteration-based run's learning rates."""
    base = [*SMALL, "--global-batch-size", "4", "--lr-decay-style", "cosine", "--lr", "1e-3",
            "--min-lr", "1e-4"]
    by_samples = LRSchedule(parse_args([*base, "--train-samples", "80",
                                        "--lr-warmup-samples", "8", "--lr-decay-samples", "72"]))
    by_iters = LRSchedule(parse_args([*base, "--train-iters", "20", "--lr-warmup-iters", "2",
                                      "--lr-decay-iters", "18"]))
    got, want = [], []
    for _ in range(20):
        got.append(by_samples.lr)
        want.append(by_iters.lr)
        by_samples.step()
        by_iters.step()
    assert got == want
    assert got[1] == pytest.approx(0.5e-3)  # linear warmup: half-way after one of two
    assert got[-1] == pytest.approx(1e-4)  # decayed to --min-lr


@pytest.mark.unit
def test_warmup_start_and_weight_decay_increment_follow_megatrons_formulas():
    """--lr-warmup-init: the warmup rises linearly from it; --weight-decay-incr-style
    linear: the decay goes from --start- to --end-weight-decay over the training's samples."""
    run = parse_args([*SMALL, "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
                      "--lr-warmup-iters", "4", "--lr-warmup-init", "1e-4",
                      "--start-weight-decay", "0.0", "--end-weight-decay", "0.1",
                      "--weight-decay-incr-style", "linear"])
    schedule, lrs, wds = LRSchedule(run), [], []
    for _ in range(10):
        lrs.append(schedule.lr)
        wds.append(schedule.weight_decay)
        schedule.step()
    assert lrs[0] == pytest.approx(1e-4) and lrs[2] == pytest.approx(1e-4 + 0.9e-3 * 2 / 4)
    assert wds[0] == 0.0 and wds[5] == pytest.approx(0.05) and wds[9] == pytest.approx(0.09)


@pytest.mark.unit
def test_weight_decay_increments_over_the_training_samples():
    """--train-samples not a multiple of the global batch: the increment spans the samples
    (Megatron-LM's wd_incr_steps = --train-samples), not the whole iterations within them."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    run = parse_args([*SMALL, "--global-batch-size", "4", "--train-samples", "42",
                      "--start-weight-decay", "0.0", "--end-weight-decay", "0.1",
                      "--weight-decay-incr-style", "linear"])
    holder = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    megatron = OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=run.optimization.lr, min_lr=run.optimization.min_lr,
        lr_warmup_steps=0, lr_decay_steps=42, lr_decay_style="linear", start_wd=0.0,
        end_wd=0.1, wd_incr_steps=42, wd_incr_style="linear")
    schedule = LRSchedule(run)
    for _ in range(run.training.train_iters):
        schedule.step()
        megatron.step(increment=4)
        assert schedule.weight_decay == holder.param_groups[0]["weight_decay"]
    assert schedule.weight_decay == pytest.approx(0.1 * 40 / 42)


@pytest.mark.unit
@pytest.mark.parametrize("flags,named", [
    (["--start-weight-decay", "0.1"], "--start-weight-decay"),
    (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler"),
])
def test_megatrons_checks_of_the_schedule_flags_are_one_line(capsys, flags, named):
    code, lines = refused(capsys, [*SMALL, *flags])
    assert code == 2 and len(lines) == 1 and named in lines[0], lines


MOCK = [*SMALL, "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
BOUNDS = ("expected an integer in [1, 4294967295] (Megatron-LM needs a positive seed; numpy, "
          "which orders the data, one below 2**32)")


@pytest.mark.unit
@pytest.mark.parametrize("flags,line", [
    (["--seed", "0"], f"--seed 0: {BOUNDS}"),
    (["--seed", "-1"], f"--seed -1: {BOUNDS}"),
    (["--seed", "4294967296"], f"--seed 4294967296: {BOUNDS}"),
    (["--lr-warmup-init", "0.001"], "--lr-warmup-init 0.001: must not exceed --lr (0.0003)"),
    (["--lr-warmup-init=-1e-5"], "--lr-warmup-init -1e-05: expected a value >= 0"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1",
      "--end-weight-decay", "0.01"],
     "--end-weight-decay 0.01: must not be below --start-weight-decay (0.1)"),
    (["--fp16", "--initial-loss-scale", "2", "--min-loss-scale", "4"],
     "--min-loss-scale 4.0: must not exceed --initial-loss-scale (2.0)"),
    (["--fp16", "--min-loss-scale", "1e10"],
     "--min-loss-scale 10000000000.0: must not exceed --initial-loss-scale (4294967296.0)"),
    (["--train-samples", "16", "--lr-decay-samples", "0"],
     "--lr-decay-samples 0: expected a positive integer"),
    (["--train-iters", "3", "--lr-warmup-fraction", "1.0"],
     "--lr-warmup-fraction 1.0: expected a value in [0, 1) (the warmup must end before the "
     "decay does)"),
    (["--train-iters", "3", "--lr-decay-style", "constant", "--lr-warmup-iters", "3"],
     "--lr-warmup-iters 3: must be below the decay's 3 (--lr-decay-iters, by default "
     "--train-iters)"),
    (["--lr-decay-style", "constant", "--lr-decay-iters", "0"],
     "--lr-decay-iters 0: expected a positive integer"),
    (["--pipeline-model-parallel-size", "0"],
     "--pipeline-model-parallel-size 0: expected a positive integer"),
])
def test_what_megatrons_scheduler_seed_and_scaler_assert_is_one_line_before_anything(
        tmp_path, capsys, flags, line):
    """Values Megatron-LM 0.19 ends in a traceback (its seed check, megatron-core's
    OptimizerParamScheduler and DynamicGradScaler asserts): one line naming the flag as
    given, exit 2, and nothing written."""
    from megatron.training.training import main

    outputs = ["--save", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "m.jsonl"),
               "--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as exc:
        main([*MOCK, *outputs, *flags])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"pretrain_llama.py: error: {line}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_save_interval_and_signal_handler_without_save_are_accepted_as_in_megatron():
    """Megatron-LM 0.19 saves only with --save: without it the interval and a signal save
    nothing, which the start says."""
    from megatron.config.checks import run_notices

    run = parse_args([*MOCK, "--save-interval", "2", "--exit-signal-handler"])
    assert run.checkpointing.save is None and run.checkpointing.save_interval == 2
    assert run_notices(run) == [
        "--exit-signal-handler without --save: SIGTERM stops the run early and nothing will "
        "be saved", "--save-interval 2 without --save: nothing will be saved"]


@pytest.mark.unit
def test_on_resume_the_schedule_is_the_checkpoints_unless_overridden():
    """--override-opt_param-scheduler: the resumed run's --lr; otherwise (and with
    --use-checkpoint-opt_param-scheduler) the checkpoint's."""
    base = [*SMALL, "--train-iters", "10", "--lr-decay-style", "constant"]
    saved = LRSchedule(parse_args([*base, "--lr", "1e-3"]))
    for _ in range(3):
        saved.step()
    lrs, kept = {}, {}
    for extra in ([], ["--use-checkpoint-opt_param-scheduler"],
                  ["--override-opt_param-scheduler"]):
        resumed = LRSchedule(parse_args([*base, "--lr", "2e-3", *extra]))
        kept[tuple(extra)] = resumed.load_state_dict(saved.state_dict())
        lrs[tuple(extra)] = (resumed.lr, resumed.num_steps)
    assert lrs == {(): (1e-3, 3), ("--use-checkpoint-opt_param-scheduler",): (1e-3, 3),
                   ("--override-opt_param-scheduler",): (2e-3, 3)}
    # what the checkpoint kept is said (the run's --lr is not used), and only that
    assert kept == {(): ["--lr 0.001 (this run's: 0.002)"],
                    ("--use-checkpoint-opt_param-scheduler",): ["--lr 0.001 (this run's: 0.002)"],
                    ("--override-opt_param-scheduler",): []}
    same = LRSchedule(parse_args([*base, "--lr", "1e-3"]))
    assert same.load_state_dict(saved.state_dict()) == []


@pytest.mark.unit
def test_dynamic_loss_scale_follows_megatrons_grad_scaler(monkeypatch):
    """Hysteresis, back-off and growth against megatron-core's DynamicGradScaler (its
    tensors moved off CUDA)."""
    from megatron.core.optimizer import grad_scaler

    from megatron.config.run import PrecisionConfig
    from megatron.pipeline.config import LossScaling

    real_tensor = torch.tensor
    monkeypatch.setattr(grad_scaler.torch, "tensor",
                        lambda *a, device=None, **k: real_tensor(*a, **k))
    reference = grad_scaler.DynamicGradScaler(
        initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=3, hysteresis=2)
    precision = PrecisionConfig(bf16=False, fp16=True, loss_scale=None,
                                initial_loss_scale=2.0**16, min_loss_scale=1.0,
                                loss_scale_window=3, hysteresis=2, optimizer_state_dtype="fp32",
                                master_dtype="fp32", master_rounding="stochastic")
    ours = LossScaling.of(precision).build()
    generator = torch.Generator().manual_seed(0)
    overflows = (torch.rand(200, generator=generator) < 0.3).tolist()
    for overflow in overflows:
        reference.update(overflow)
        ours.update(overflow)
        assert ours.scale == float(reference.scale)


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.multiproc
def test_pipeline_size_one_on_two_processes_is_data_parallel_one_process_training(
        tmp_path, demo_cache):
    common = [*SMALL, "--micro-batch-size", "2", "--global-batch-size", "4",
              "--train-iters", "3", "--data-cache-path", demo_cache, "--log-interval", "1"]
    two = forked_ranks.start("pretrain_llama.py", [*common, "--pipeline-model-parallel-size",
                                                   "1", "--metrics-file", str(tmp_path / "dp.jsonl")],
                             2, env={"OMP_NUM_THREADS": "1"})
    one = forked_ranks.launch("pretrain_llama.py",
                              [*common, "--metrics-file", str(tmp_path / "one.jsonl")])
    assert one.returncode == 0, one.stderr[-3000:]
    result = two.wait(300)
    assert result.returncode == 0, result.stderr[-3000:]
    replicas, single = _metrics(tmp_path / "dp.jsonl"), _metrics(tmp_path / "one.jsonl")
    assert [r["iteration"] for r in replicas] == [1, 2, 3]
    for got, want in zip(replicas, single):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.mark.multiproc
def test_megatrons_llama_launch_trains_on_two_processes(tmp_path):
    """The whole flag set above, under torchrun's environment on 2 processes: it trains
    its 10 iterations (40 samples) in bf16 and saves where --save says."""
    argv = [str(tmp_path / "ckpt") if a == "ckpt" else a for a in MEGATRON_LLAMA_LAUNCH]
    metrics = tmp_path / "metrics.jsonl"
    result = forked_ranks.launch("pretrain_llama.py", [
        *argv, "--data-cache-path", str(tmp_path), "--metrics-file", str(metrics)], 2,
        env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert "throughput per GPU (TFLOP/s/GPU)" in result.stdout
    assert (tmp_path / "ckpt" / "iter_0000010" / "metadata.json").exists()


@pytest.mark.multiproc
def test_mock_data_trains_as_in_megatrons_examples(tmp_path):
    """--mock-data --tokenizer-type NullTokenizer --vocab-size N (megatron-core's
    MockGPTDataset): it trains, and the first loss is that of a uniform guess over the
    padded vocabulary."""
    metrics = tmp_path / "mock.jsonl"
    result = forked_ranks.launch("pretrain_llama.py", [
        *SMALL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--train-iters", "2", "--eval-iters", "1", "--data-cache-path", str(tmp_path),
        "--metrics-file", str(metrics)])
    assert result.returncode == 0, result.stderr[-3000:]
    first = _metrics(metrics)[0]
    # Megatron-LM 0.19's NullTokenizer: 1000 ids (the end of document 999), padded to 1024
    assert first["loss"] == pytest.approx(math.log(1024), abs=0.1)
    assert "validation loss at iteration 2 on validation set" in result.stdout


@pytest.mark.multiproc
def test_a_refusal_under_torchrun_is_one_line_from_one_rank_and_every_rank_exits_2(demo_cache):
    result = forked_ranks.launch("pretrain_llama.py",
                                 [*SMALL, "--tensor-model-parallel-size", "2"], 2)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "tensor parallelism is not supported" in errors[0]
    assert "exit status 2" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.multiproc
@pytest.mark.slow
def test_the_megatron_style_example_launch_trains_and_resumes(tmp_path, demo_cache):
    """examples/megatron_llama2_launch.sh as a user runs it (torchrun on 2 processes, --save
    and --load the same directory): it trains from scratch, and a second launch resumes
    where the first stopped."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    env = {**os.environ, "GPUS_PER_NODE": "2", "MODEL_SIZE": "tiny",
           "TORCHRUN": os.path.join(ROOT, ".venv", "bin", "torchrun"), "OMP_NUM_THREADS": "1"}

    def launch(iters, metrics):
        return subprocess.run(
            ["bash", os.path.join(ROOT, "examples", "megatron_llama2_launch.sh"), str(ckpt),
             str(tb), "DEMO", "DEMO", "--train-iters", str(iters), "--save-interval", "2",
             "--data-cache-path", demo_cache, "--metrics-file", str(tmp_path / metrics),
             "--num-layers", "2", "--seq-length", "64", "--max-position-embeddings", "64",
             "--log-interval", "1"],
            env=env, capture_output=True, text=True, timeout=300)

    with reserved_port() as port:  # torchrun's agent binds it
        env["MASTER_PORT"] = str(port)
        first = launch(2, "first.jsonl")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting from scratch" in first.stdout + first.stderr
    assert "throughput per GPU (TFLOP/s/GPU)" in first.stdout
    assert [r["iteration"] for r in _metrics(tmp_path / "first.jsonl")] == [1, 2]
    # The resume: the script's own command line (TORCHRUN=echo prints it) on ranks forked
    # from the session's zygote, not a second torchrun start-up.
    env["TORCHRUN"] = "echo"
    printed = launch(3, "second.jsonl").stdout.split()
    second = forked_ranks.launch("pretrain_llama.py",
                                 printed[printed.index("pretrain_llama.py") + 1:], 2,
                                 env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt} at iteration 2" in second.stdout + second.stderr
    assert [r["iteration"] for r in _metrics(tmp_path / "second.jsonl")] == [3]
