"""What a Megatron user expects of the loop, checked in one process: bad input rejected
before training, forward-only evaluation programs, weighted data blends, exit conditions,
TensorBoard scalars."""

import math
import os
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.config.errors import ConfigError
from megatron.config.run import ExitConfig
from megatron.data.blend import data_blend
from megatron.data.datasets import build_datasets
from megatron.data.indexed_dataset_writer import write_indexed_dataset
from megatron.data.run_data import prepare_data
from megatron.data.tokenizer import train_bpe_tokenizer
from megatron.models.llama import LlamaConfig
from megatron.schedules.cost_model import uniform_costs
from megatron.schedules.generators import build_schedule
from megatron.schedules.instructions import Instruction, Op, Schedule
from megatron.schedules.interpreter import ScheduleError
from megatron.schedules.lowering import forward_only_schedule
from megatron.schedules.simulator import simulate
from megatron.schedules.validator import RULE_FORWARD_ONLY, validate
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, OwnedState
from megatron.training.checkpointing import CheckpointSaver
from megatron.training.distributed import DistInfo, initialize_distributed, shutdown_distributed
from megatron.training.evaluation import due, format_evaluation, perplexity
from megatron.training.metrics import LogInterval, format_log_line
from megatron.training.run_checks import (
    check_checkpoint_model,
    check_checkpoint_vocabulary,
    resume_shape_notice,
)
from megatron.training.scalar_logging import ScalarSinks
from megatron.training.signals import ExitConditions
from megatron.training.training import train

TINY = ["--model-preset", "tiny", "--train-iters", "4"]


# --- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "argv,flag,fragment",
    [
        (["--lr", "nan"], "--lr", "finite"),
        (["--min-lr", "inf"], "--min-lr", "finite"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr", "must not exceed --lr"),
        (["--adam-beta1", "1.0"], "--adam-beta1", "[0, 1)"),
        (["--adam-beta2", "-0.1"], "--adam-beta2", "[0, 1)"),
        (["--adam-eps", "0"], "--adam-eps", "> 0"),
        (["--weight-decay", "-0.1"], "--weight-decay", ">= 0"),
        (["--clip-grad", "-1"], "--clip-grad", ">= 0"),
        (["--initial-loss-scale", "0"], "--initial-loss-scale", "> 0"),
        (["--eval-interval", "0", "--split", "90,8,2"], "--eval-interval", "positive"),
        (["--eval-iters", "-1"], "--eval-iters", ">= 0"),
        (["--eval-interval", "5"], "--eval-interval", "needs a validation set"),
        (["--split", "90,x"], "--split", "non-negative weights"),
        (["--split", "0,0,0"], "--split", "not all 0"),
        (["--exit-interval", "0"], "--exit-interval", "positive"),
        (["--exit-duration-in-mins", "nan"], "--exit-duration-in-mins", "> 0"),
        (["--data-path", "0.7", "a", "b", "--tokenizer-model", "t"], "--data-path", "WEIGHT PREFIX"),
        (["--data-path", "-1", "a", "1", "b", "--tokenizer-model", "t"], "--data-path", "weights > 0"),
        (["--valid-data-path", "v"], "--train-data-path", "required"),
        (["--data-path", "a", "--train-data-path", "b", "--tokenizer-model", "t"],
         "--train-data-path", "not both"),
        (["--wandb-exp-name", "x"], "--wandb-exp-name", "--wandb-project"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_flag_and_value(argv, flag, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*TINY, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and fragment in err, err


def _train_rejects(tmp_path, *argv) -> ConfigError:
    """train() in this process: the error comes before any data, model or file is made."""
    run = parse_args([*TINY, "--data-cache-dir", str(tmp_path / "cache"), *argv])
    with pytest.raises(ConfigError) as exc:
        train(run, DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo"))
    assert not (tmp_path / "cache").exists()  # no corpus built, nothing allocated
    return exc.value


def test_a_schedule_too_large_is_refused_before_the_data_phase_writes_anything(tmp_path):
    """--global-batch-size 40000000 on a pipeline: one line naming the flag and the limit,
    before the data phase (which would write gigabytes of index files under the cache)."""
    error = _train_rejects(tmp_path, "--pipeline-schedule", "decoupled",
                           "--global-batch-size", "40000000", "--save", str(tmp_path / "ckpt"))
    assert error.flag == "--global-batch-size" and error.value == 40000000
    assert "FORWARD/BACKWARD instructions per iteration, expected at most 100000" in str(error)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag", ["--metrics-file", "--timeline", "--trace"])
def test_unwritable_output_files_are_rejected_before_training(tmp_path, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    error = _train_rejects(tmp_path, flag, str(blocker / "out"))
    assert error.flag == flag and error.value == str(blocker / "out")
    assert os.listdir(tmp_path) == ["a-file"]


def test_output_file_that_is_a_directory_is_rejected(tmp_path):
    error = _train_rejects(tmp_path, "--metrics-file", str(tmp_path))
    assert error.flag == "--metrics-file" and "directory" in error.expected


def test_unwritable_tensorboard_dir_is_rejected_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    error = _train_rejects(tmp_path, "--tensorboard-dir", str(blocker / "tb"))
    assert error.flag == "--tensorboard-dir"


def test_load_of_a_missing_directory_is_an_error_unless_optional(tmp_path):
    error = _train_rejects(tmp_path, "--load", str(tmp_path / "typo"))
    assert error.flag == "--load" and "--load-optional" in error.expected
    run = parse_args([*TINY, "--load", str(tmp_path / "typo"), "--load-optional"])
    assert run.checkpointing.load_optional


@pytest.mark.unit
def test_wandb_files_go_where_megatron_puts_them(tmp_path, monkeypatch):
    """W&B's local files: --wandb-save-dir, else --save's wandb/ (Megatron's); the entity."""
    import sys
    import types

    runs = []
    fake = types.SimpleNamespace(init=lambda **kwargs: runs.append(kwargs))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save = str(tmp_path / "ckpt")
    ScalarSinks(parse_args([*TINY, "--wandb-project", "p", "--save", save]), enabled=True)
    ScalarSinks(parse_args([*TINY, "--wandb-project", "p", "--save", save, "--wandb-save-dir",
                            str(tmp_path / "w"), "--wandb-entity", "team"]), enabled=True)
    assert [(r["dir"], r.get("entity")) for r in runs] == [
        (os.path.join(save, "wandb"), None), (str(tmp_path / "w"), "team")]
    assert os.path.isdir(runs[0]["dir"]) and os.path.isdir(runs[1]["dir"])


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    error = _train_rejects(tmp_path, "--wandb-project", "p")
    assert error.flag == "--wandb-project" and "not installed" in error.expected


def _saved_checkpoint(root, flags, **common) -> str:
    """A checkpoint at iteration 3 that recorded the run configuration `flags` (and
    `common`), its tensors a stand-in."""
    saved = parse_args([*TINY, *flags])
    initialize_distributed()  # megatron-core's sharded layout needs its process groups
    try:
        saver = CheckpointSaver(str(root), LlamaConfig(
            num_layers=6, hidden_size=4, ffn_hidden_size=8, num_attention_heads=1,
            num_query_groups=1, vocab_size=8, seq_length=8), async_save=False)
        tensors = {prefix + "decoder.final_layernorm.weight": torch.ones(4)
                   for prefix in (MASTER, EXP_AVG, EXP_AVG_SQ)}
        saver.save(3, OwnedState(tensors, optimizer_step=3, loss_scaler=None),
                   {"args": saved.flags(), "lr_schedule": {"num_steps": 3},
                    "consumed_samples": 3 * saved.training.global_batch_size, **common})
        saver.close()
    finally:
        shutdown_distributed()
    return str(root)


def test_loading_a_checkpoint_of_another_model_names_both_values(tmp_path):
    load = _saved_checkpoint(tmp_path / "ckpt", ["--num-layers", "6"])
    error = _train_rejects(tmp_path, "--load", load)
    assert str(error) == f"--num-layers 4: the checkpoint in {load} was saved with 6"


def test_another_vocabulary_is_refused_before_the_data_in_terms_of_the_flag(tmp_path):
    """The checkpoint was saved with the tokenizer's vocabulary (4096 rows, no
    --vocab-size); the resume gives --vocab-size 5000, which pads to 5120 rows: one line
    naming the flag and both row counts, before the data (no cache) or the model."""
    load = _saved_checkpoint(tmp_path / "ckpt", [], padded_vocab_size=4096)
    error = _train_rejects(tmp_path, "--load", load, "--vocab-size", "5000")
    assert str(error) == ("--vocab-size 5000: pads to 5120 rows (a multiple of "
                          "--make-vocab-size-divisible-by 128); the checkpoint in "
                          f"{load} has 4096 (its embedding and output layer rows)")
    # 4000 pads to 4096: the same rows, accepted (as Megatron does)
    check_checkpoint_vocabulary(parse_args([*TINY, "--vocab-size", "4000"]), {}, load, 4096)


def test_another_tokenizer_or_padding_is_named_once_the_vocabulary_is_known():
    saved = parse_args(TINY).flags()
    other = parse_args([*TINY, "--tokenizer-model", "/tok/other.json"])
    check_checkpoint_vocabulary(other, saved, "/ckpt", 4096)  # not known before the data
    with pytest.raises(ConfigError) as exc:
        check_checkpoint_vocabulary(other, saved, "/ckpt", 4096, vocab_rows=8064)
    assert str(exc.value) == (
        "--tokenizer-model /tok/other.json: its vocabulary pads to 8064 rows (a multiple of "
        "--make-vocab-size-divisible-by 128); the checkpoint in /ckpt has 4096 (its embedding "
        "and output layer rows): the checkpoint of another tokenizer (give --vocab-size to pad "
        "to its rows)")
    divisor = parse_args([*TINY, "--make-vocab-size-divisible-by", "1000"])
    with pytest.raises(ConfigError, match=r"^--make-vocab-size-divisible-by 1000: the "
                                          r"vocabulary pads to 5000 rows; the checkpoint in "
                                          r"/ckpt has 4096 \(its embedding and output layer "
                                          r"rows\), padded to a multiple of 128$"):
        check_checkpoint_vocabulary(divisor, saved, "/ckpt", 4096, vocab_rows=5000)


def test_with_a_tokenizer_that_knows_its_vocabulary_the_tokenizer_is_named_not_vocab_size():
    """Megatron-LM 0.19's --tokenizer-type HuggingFaceTokenizer ignores --vocab-size: the
    rows are the tokenizer's, checked once it is read, and the line names the tokenizer."""
    hf = parse_args([*TINY, "--data-path", "d", "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", "/tok/hf", "--vocab-size", "5000"])
    check_checkpoint_vocabulary(hf, {}, "/ckpt", 4096)  # not known before the data
    with pytest.raises(ConfigError) as exc:
        check_checkpoint_vocabulary(hf, {}, "/ckpt", 4096, vocab_rows=384)
    assert str(exc.value) == (
        "--tokenizer-model /tok/hf: its vocabulary pads to 384 rows (a multiple of "
        "--make-vocab-size-divisible-by 128); the checkpoint in /ckpt has 4096 (its embedding "
        "and output layer rows): the checkpoint of another tokenizer")


def test_model_flags_must_match_the_checkpoint():
    run = parse_args([*TINY, "--num-layers", "6"])
    saved = parse_args(TINY).flags()
    with pytest.raises(ConfigError) as exc:
        check_checkpoint_model(run, saved, "/ckpt")
    assert str(exc.value) == "--num-layers 6: the checkpoint in /ckpt was saved with 4"
    check_checkpoint_model(parse_args(TINY), saved, "/ckpt")  # same flags: accepted
    # another sequence length, resumed or fine-tuned (a longer context), as Megatron-LM
    # accepts it: no weight has its shape
    check_checkpoint_model(parse_args([*TINY, "--seq-length", "4096"]), saved, "/ckpt")
    rope = parse_args([*TINY, "--rotary-base", "500000"])
    with pytest.raises(ConfigError, match="--rotary-base 500000: the checkpoint in /ckpt was "
                                          "saved with 10000"):
        check_checkpoint_model(rope, saved, "/ckpt")
    # fine-tuning may change it (a longer context's rotary base)
    finetune = parse_args([*TINY, "--rotary-base", "500000", "--load", "/ckpt", "--finetune"])
    check_checkpoint_model(finetune, saved, "/ckpt")
    # a head width given at save time, left to its default (hidden / heads) now: compared
    wide = parse_args([*TINY, "--kv-channels", "64"]).flags()
    with pytest.raises(ConfigError, match="--kv-channels 32: the checkpoint in /ckpt was "
                                          "saved with 64"):
        check_checkpoint_model(parse_args(TINY), wide, "/ckpt")
    check_checkpoint_model(parse_args([*TINY, "--kv-channels", "32"]), saved, "/ckpt")


def test_a_resume_on_another_shape_says_it_is_not_bit_exact():
    saved = {"format_version": 3, "world_size": 2, "args": parse_args(TINY).flags()}
    same = parse_args(TINY)
    assert resume_shape_notice(same, saved, 2, "/ckpt") is None
    # the default schedule named or not: the same
    assert resume_shape_notice(parse_args([*TINY, "--pipeline-schedule", "decoupled"]),
                               saved, 2, "/ckpt") is None
    line = resume_shape_notice(parse_args([*TINY, "--micro-batch-size", "1"]), saved, 2,
                               "/ckpt")
    assert line == ("resuming the checkpoint in /ckpt with --micro-batch-size 1 (saved with "
                    "4): it continues at the same sample within rounding of the run that "
                    "saved it, not bit for bit (each iteration's sums run in another order); "
                    "the saved flags on as many processes continue it exactly")
    other = resume_shape_notice(parse_args([*TINY, "--pipeline-schedule", "1f1b"]), saved, 3,
                                "/ckpt")
    assert other.startswith("resuming the checkpoint in /ckpt with 3 process(es) (saved on "
                            "2), --pipeline-schedule 1f1b (saved with decoupled): ")
    finetune = parse_args([*TINY, "--micro-batch-size", "1", "--load", "/ckpt", "--finetune"])
    assert resume_shape_notice(finetune, saved, 2, "/ckpt") is None  # starts over
    megatron_lm = {"args": saved["args"], "iteration": 10}  # another program's: not continued
    assert resume_shape_notice(parse_args([*TINY, "--micro-batch-size", "1"]), megatron_lm, 1,
                               "/ckpt") is None


# --- evaluation ------------------------------------------------------------------------

def test_defaults_follow_megatron_where_there_is_a_validation_set():
    run = parse_args([*TINY, "--split", "969,30,1"])
    assert (run.eval_interval, run.eval_iters) == (None, 100)
    assert [due(i, run) for i in (1, 1000)] == [False, False]  # only at the end
    assert parse_args(TINY).eval_iters == 0  # no validation set: no evaluation
    run = parse_args([*TINY, "--train-iters", "12", "--eval-interval", "5", "--eval-iters", "2",
                      "--split", "90,8,2"])
    batch = run.training.global_batch_size
    # Megatron's sizes: (12 // 5 + 1) evaluations of 2 batches; one run for the test set.
    assert run.split_sizes == [12 * batch, 3 * 2 * batch, 2 * batch]


def test_evaluation_block_is_megatrons():
    block = format_evaluation("iteration 5", 2.0).splitlines()
    assert block[1] == " validation loss at iteration 5 | lm loss value: 2.000000E+00 | " \
                       f"lm loss PPL: {math.exp(2.0):.6E} | "
    assert block[0] == block[2] == "-" * (len(block[1]) + 1)
    assert perplexity(100.0) == math.exp(20)


def test_the_line_reduces_its_interval_as_megatron_0_19():
    """training_log's sums by hand: the loss averaged over the iterations that updated,
    the time over all of them, a skipped iteration counted, and as nan when its loss was
    not finite; no loss before the first update, 0 for an interval that only skipped."""
    interval = LogInterval()
    interval.add({"skipped": True, "loss": 9.0}, 0.5)
    assert interval.fields()["loss"] is None  # nothing updated yet: no "lm loss" field
    interval.clear()
    for loss, skipped, seconds in ((4.0, False, 0.1), (math.inf, True, 0.3),
                                   (math.nan, True, 0.1), (5.0, True, 0.2), (3.0, False, 0.3)):
        interval.add({"skipped": skipped, "loss": loss, "gpu_time_s": 2 * seconds}, seconds)
    fields = interval.fields()
    assert fields["loss"] == (4.0 + 3.0) / 2
    assert (fields["skipped_iterations"], fields["nan_iterations"]) == (3, 2)
    assert interval.seconds_per_iteration == pytest.approx(1.0 / 5)
    assert fields["gpu_time_s"] == pytest.approx(2.0 / 5)
    line = format_log_line({"iteration": 5, "consumed_samples": 40, "iter_time_s": 0.2,
                            "tokens_per_s": 100.0, "lr": 1e-3, "global_batch_size": 8,
                            "loss_scale": None, "grad_norm": math.inf, **fields}, 10)
    assert ("| lm loss: 3.500000E+00 | loss scale: 1.0 | number of skipped iterations:   3 "
            "| number of nan iterations:   2 |") in line
    interval.clear()
    interval.add({"skipped": True, "loss": 5.0}, 0.1)
    assert interval.fields()["loss"] == 0.0  # 0.19 prints 0 once a loss was ever summed


SHAPES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved-1f1b", 4, 1), ("mobius", 4, 1),
          ("decoupled", 4, 2)]


@pytest.mark.parametrize("name,stages,split", SHAPES)
def test_every_schedule_has_a_valid_forward_only_program(name, stages, split):
    training = build_schedule(name, 2, stages, split, 4)
    evaluation = forward_only_schedule(training)
    report = validate(evaluation)
    for rank, program in enumerate(evaluation.programs):
        ops = {ins.op for ins in program}
        assert ops <= {Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT, Op.PREFETCH_PARAMS,
                       Op.RELEASE_PARAMS}
        # The same forwards, in the same order, on the same ranks as training.
        assert [i for i in program if i.op == Op.FORWARD] == \
               [i for i in training.programs[rank] if i.op == Op.FORWARD]
    assert report.peak_checkpoints == (0, 0)
    sim = simulate(evaluation, uniform_costs(evaluation))
    assert sim.exposed_optimizer_time == 0
    assert sim.iteration_time < simulate(training, uniform_costs(training)).iteration_time


def test_the_validator_rejects_training_work_in_a_forward_only_program():
    evaluation = forward_only_schedule(build_schedule("gpipe", 2, 2, 1, 2))
    programs = list(evaluation.programs)
    programs[1] = programs[1][:-1] + (Instruction(Op.OPTIMIZER_WAIT_ALL), programs[1][-1])
    broken = Schedule(**{**vars(evaluation), "programs": tuple(programs)})
    with pytest.raises(ScheduleError, match=RULE_FORWARD_ONLY):
        validate(broken)


# --- data blends -----------------------------------------------------------------------

WORDS_A = "alpha beta gamma delta epsilon zeta".split()
WORDS_B = "one two three four five six".split()


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    # megatron-core's BlendedDataset asks torch.distributed for the rank (training always
    # has a process group, one process included): a one-process group for these tests.
    own_group = not torch.distributed.is_initialized()
    if own_group:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
    root = tmp_path_factory.mktemp("blend")
    docs_a = [" ".join(WORDS_A[(i + j) % 6] for j in range(5 + i % 7)) for i in range(60)]
    docs_b = [" ".join(WORDS_B[(i + j) % 6] for j in range(5 + i % 7)) for i in range(60)]
    tokenizer = train_bpe_tokenizer(docs_a + docs_b, 300, str(root / "tokenizer.json"))
    for name, docs in (("a", docs_a), ("b", docs_b)):
        write_indexed_dataset(docs, tokenizer, str(root / name), log=lambda _: None)
    yield str(root / "a"), str(root / "b"), tokenizer, root
    if own_group:
        torch.distributed.destroy_process_group()


def _source(tokenizer, sample) -> str:
    text = tokenizer.detokenize(sample["tokens"].tolist())
    words = set(text.replace("<|endoftext|>", " ").split())
    assert not (words & set(WORDS_A) and words & set(WORDS_B)), text
    return "a" if words & set(WORDS_A) else "b"


def test_a_weighted_blend_samples_each_dataset_in_its_proportion(two_datasets, tmp_path):
    a, b, tokenizer, _ = two_datasets
    data = parse_args([*TINY, "--data-path", "0.7", a, "0.3", b, "--split", "1,0,0",
                       "--tokenizer-model", "t"]).data
    blend = data_blend(data, None)
    train_ds = build_datasets(blend, tokenizer, 8, [1000, 0, 0], seed=3,
                              cache_dir=str(tmp_path))[0]
    counts = {"a": 0, "b": 0}
    for i in range(1000):
        counts[_source(tokenizer, train_ds[i])] += 1
    assert abs(counts["a"] - 700) <= 2 and abs(counts["b"] - 300) <= 2, counts


def test_per_split_paths_give_each_split_its_own_data(two_datasets, tmp_path):
    a, b, tokenizer, _ = two_datasets
    data = parse_args([*TINY, "--train-data-path", a, "--valid-data-path", b]).data
    train_ds, valid_ds, test_ds = build_datasets(
        data_blend(data, None), tokenizer, 8, [50, 20, 0], seed=3,
        cache_dir=str(tmp_path))
    assert test_ds is None
    assert {_source(tokenizer, train_ds[i]) for i in range(50)} == {"a"}
    assert {_source(tokenizer, valid_ds[i]) for i in range(20)} == {"b"}


def test_train_samples_build_the_training_order_megatron_builds(two_datasets, tmp_path):
    """--train-samples asks the dataset for that many samples, as Megatron-LM's
    get_train_valid_test_num_samples does, not for the whole global batches within them:
    megatron-core's sample order depends on the count (one shuffle over all epochs when
    the last is at least 80% full, else the last shuffled apart), and the run reads
    Megatron's order. The reference: the dataset built for exactly --train-samples."""
    a, _, tokenizer, root = two_datasets
    blend = data_blend(parse_args([*TINY, "--data-path", a, "--split", "1,0,0",
                                   "--tokenizer-model", "t"]).data, None)

    def built(samples: int):
        return build_datasets(blend, tokenizer, 8, [samples, 0, 0], seed=1234,
                              cache_dir=str(tmp_path / str(samples)))[0]

    epoch = len(built(1))
    samples = epoch + math.ceil(0.8 * epoch)  # the last epoch just 80% full: one shuffle
    batch = next(b for b in (2, 3, 4, 5) if samples % b)
    run = parse_args(["--model-preset", "tiny", "--data-path", a, "--split", "1,0,0",
                      "--tokenizer-model", str(root / "tokenizer.json"), "--seq-length", "8",
                      "--micro-batch-size", "1", "--global-batch-size", str(batch),
                      "--train-samples", str(samples), "--eval-iters", "0",
                      "--data-cache-path", str(tmp_path / "run")])
    ours = prepare_data(run, log=lambda *_: None).datasets.train
    megatron = built(samples)
    consumed = run.training.train_iters * batch
    first = [megatron[i]["tokens"].tolist() for i in range(consumed)]
    assert first != [built(consumed)[i]["tokens"].tolist() for i in range(consumed)]
    assert [ours[i]["tokens"].tolist() for i in range(consumed)] == first


def test_a_missing_prefix_of_a_blend_is_named_with_its_flag(two_datasets):
    a, _, _, root = two_datasets
    data = parse_args([*TINY, "--data-path", "0.5", a, "0.5", str(root / "none"),
                       "--tokenizer-model", "t"]).data
    with pytest.raises(ConfigError) as exc:
        data_blend(data, None)
    assert exc.value.flag == "--data-path" and exc.value.value == str(root / "none")


# --- exit conditions -------------------------------------------------------------------

def _exit_args(**values):
    base = {"exit_interval": None, "exit_duration_in_mins": None, "exit_signal_handler": False,
            "exit_signal": "SIGTERM"}
    return ExitConfig(**{**base, **values})


def test_exit_interval_and_duration():
    exits = ExitConditions(_exit_args(exit_interval=3), start_time=0.0, agree=None)
    assert [exits.reason(i) for i in (1, 2)] == [None, None]
    assert "--exit-interval 3" in exits.reason(3)
    import time
    late = ExitConditions(_exit_args(exit_duration_in_mins=1.0), time.time() - 61, agree=None)
    assert "--exit-duration-in-mins" in late.reason(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_is_acted_on_after_the_iteration_and_agreed(sig):
    agreed = []
    exits = ExitConditions(_exit_args(exit_signal_handler=True), 0.0, agree=agreed.append)
    try:
        assert exits.reason(1) is None
        os.kill(os.getpid(), sig)  # the handler only sets a flag
        assert signal.Signals(sig).name in exits.reason(2)
        assert len(agreed) == 2 and all(t.numel() == 2 for t in agreed)  # one small tensor
    finally:
        exits.close()
    assert signal.getsignal(sig) is not exits._on_signal  # handlers restored


def test_another_ranks_signal_stops_this_rank_too():
    def another_rank_was_signalled(flags: torch.Tensor) -> None:
        flags[0] = max(float(flags[0]), 1.0)  # what the MAX all-reduce brings back

    exits = ExitConditions(_exit_args(exit_signal_handler=True), 0.0,
                           agree=another_rank_was_signalled)
    try:
        assert "received" in exits.reason(1)
    finally:
        exits.close()


# --- TensorBoard -----------------------------------------------------------------------

def test_tensorboard_scalars_read_back_under_megatrons_names(tmp_path):
    sinks = ScalarSinks(parse_args([*TINY, "--tensorboard-dir", str(tmp_path),
                                    "--log-timers-to-tensorboard"]), enabled=True)
    for it in (1, 2, 3):
        sinks.training({"iteration": it, "loss": 5.0 - it, "lr": 1e-3, "loss_scale": None,
                        "grad_norm": 0.5, "iter_time_s": 0.1, "tokens_per_s": 100.0,
                        "global_batch_size": 8, "consumed_samples": 8 * it,
                        "bubble_time_s": 0.01, "skipped": False})
    sinks.evaluation({"iteration": 3, "evaluation": "validation", "lm_loss": 1.5,
                      "lm_loss_ppl": math.exp(1.5)}, consumed_samples=24)
    sinks.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-second",
            "batch-size", "pipeline/bubble-time", "lm loss validation",
            "lm loss validation ppl", "lm loss vs samples"} <= tags
    assert "loss-scale" not in tags  # not reported: no loss scaling in fp32
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24]


@pytest.mark.unit
def test_tensorboard_log_interval_writes_every_nth_iteration_as_megatron(tmp_path, monkeypatch):
    import torch.utils.tensorboard as tensorboard

    queues = []

    class Writer(tensorboard.SummaryWriter):
        def __init__(self, *args, **kwargs):
            queues.append(kwargs.get("max_queue"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tensorboard, "SummaryWriter", Writer)
    sinks = ScalarSinks(parse_args([*TINY, "--tensorboard-dir", str(tmp_path),
                                    "--tensorboard-log-interval", "2",
                                    "--tensorboard-queue-size", "10"]), enabled=True)
    assert queues == [10]
    for it in (1, 2, 3, 4):
        sinks.training({"iteration": it, "loss": 5.0 - it, "lr": 1e-3,
                        "global_batch_size": 8, "consumed_samples": 8 * it})
    sinks.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(2, 3.0), (4, 1.0)]
