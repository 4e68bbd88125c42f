"""Checkpoints as Megatron-LM 0.19 (megatron-core 0.19.2) writes and reads them.

tests/fixtures/mcore019_checkpoint was written by Megatron-LM 0.19's own save_checkpoint
(tests/fixtures/make_mcore019_checkpoint.py): the common state inside the torch_dist files,
no common.pt. The references are megatron-core's: its load strategy into a GPTModel, its
OptimizerParamScheduler, and (where MEGATRON_CORE_019_PYTHON names a Python with
megatron-core 0.19.2) Megatron-LM 0.19 itself reading our checkpoint."""

import os
import shutil
import subprocess
import types

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.data.run_data import prepare_data
from megatron.data.sampling import training_micro_batches
from megatron.models.llama import LlamaConfig
from megatron.training.arguments import parse_args
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import main, train
from tests.test_checkpoint_mcore import gpt_model

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
MCORE019 = os.path.join(FIXTURES, "mcore019_checkpoint")
ITERATION, BATCH = 10, 8  # the fixture's
# the fixture's flags (make_mcore019_checkpoint.FLAGS) as this project's
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", str(BATCH),
         "--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.01",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--eval-iters", "0", "--log-interval", "1"]


@pytest.fixture
def one_process():
    yield initialize_distributed()
    shutdown_distributed()


def megatron_lr_after(samples: int, train_iters: int = 20) -> float:
    """Megatron-LM's scheduler for FLAGS (steps count samples) after `samples`."""
    holder = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.01}])
    scheduler = OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * BATCH,
        lr_decay_steps=train_iters * BATCH, lr_decay_style="cosine", start_wd=0.01,
        end_wd=0.01, wd_incr_steps=train_iters * BATCH, wd_incr_style="constant")
    scheduler.step(increment=samples)
    return holder.param_groups[0]["lr"]


def load_gpt_model(cfg: LlamaConfig, directory: str):
    """megatron-core's GPTModel with the weights its load strategy reads from `directory`
    (megatron-core 0.16's dist_checkpointing.load itself wants a common.pt)."""
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    gpt = gpt_model(cfg)
    sharded = {k: v for k, v in gpt.sharded_state_dict().items()
               if not k.endswith("_extra_state")}
    sharded, _, factories = load_preprocess(sharded)
    loaded = TorchDistLoadShardedStrategy().load(sharded, directory)
    gpt.load_state_dict(apply_factory_merges(loaded, factories), strict=False)
    return gpt


def gpt_loss(directory: str, run, iteration: int) -> float:
    """megatron-core's GPTModel, its weights read by megatron-core's own load strategy
    from `directory`, on the micro-batches of `iteration`: the mean loss."""
    m = run.model
    cfg = LlamaConfig(num_layers=m.num_layers, hidden_size=m.hidden_size,
                      ffn_hidden_size=m.ffn_hidden_size,
                      num_attention_heads=m.num_attention_heads,
                      num_query_groups=m.num_query_groups, vocab_size=128,
                      seq_length=m.seq_length, seed=run.training.seed)
    gpt = load_gpt_model(cfg, directory)
    data = prepare_data(run, log=lambda *_: None)
    seq = m.seq_length
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    losses = []
    with torch.no_grad():
        for b in training_micro_batches(data.datasets.train, iteration, run):
            per_token = gpt(b["tokens"], torch.arange(seq).expand_as(b["tokens"]), mask,
                            labels=b["labels"])
            losses.append(float((per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()))
    return sum(losses) / len(losses)


def test_a_megatron_lm_0_19_checkpoint_resumes_where_it_stopped(tmp_path, capsys,
                                                                one_process):
    """--load of Megatron-LM 0.19's checkpoint: iteration 11 next, its consumed samples, the
    LR of Megatron's scheduler, and the first loss is GPTModel's on the same batch. The
    mock data's indices go to --data-cache-path."""
    cache = str(tmp_path / "cache")
    argv = [*FLAGS, "--load", MCORE019, "--data-cache-path", cache, "--exit-interval", "11"]
    first = train(parse_args(argv), one_process)[0]
    out = capsys.readouterr()
    assert f"loaded checkpoint from {MCORE019} at iteration {ITERATION}" in out.out
    assert first["iteration"] == ITERATION + 1
    assert first["consumed_samples"] == (ITERATION + 1) * BATCH
    assert first["lr"] == pytest.approx(megatron_lr_after((ITERATION + 1) * BATCH), rel=1e-12)
    run = parse_args(argv)
    assert first["loss"] == pytest.approx(
        gpt_loss(os.path.join(MCORE019, f"iter_{ITERATION:07d}"), run, ITERATION + 1), abs=1e-5)
    assert "Unable to save" not in out.out + out.err  # megatron-core's line without a cache
    assert any(f.endswith("MockGPTDataset-train-sample_index.npy")
               for f in os.listdir(os.path.join(cache, "gpt-index", "mock")))


def test_use_checkpoint_args_rebuilds_the_model_from_megatrons_args():
    """No model flag given: Megatron-LM 0.19's recorded args give the sizes."""
    run = parse_args(["--use-checkpoint-args", "--load", MCORE019, "--mock-data",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
    m = run.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads,
            m.num_query_groups, m.seq_length) == (2, 64, 160, 4, 2, 32)


@pytest.mark.parametrize("common,missing", [
    ({}, "records no iteration"),
    ({"iteration": ITERATION, "args": types.SimpleNamespace(consumed_train_samples=80)},
     "records no LR scheduler state"),
])
def test_a_checkpoint_that_cannot_resume_exactly_is_refused(tmp_path, capsys, common, missing):
    """Megatron reads common.pt before the `common_state` inside: a common.pt lacking the
    iteration or the schedule is refused in one line pointing at --finetune, exit 2."""
    root = tmp_path / "ckpt"
    shutil.copytree(MCORE019, root)
    torch.save(common, root / f"iter_{ITERATION:07d}" / "common.pt")
    with pytest.raises(SystemExit) as exit_:
        main([*FLAGS, "--load", str(root), "--data-cache-path", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert missing in err[0] and "--finetune starts from its weights at iteration 0" in err[0]


@pytest.mark.parametrize("flag,value", [("use_rope_scaling", True),
                                        ("rotary_interleaved", True)])
def test_a_checkpoint_of_another_architecture_is_refused_by_load_and_export(
        tmp_path, capsys, flag, value):
    """Megatron-LM's LLaMA 3.1 (--use-rope-scaling) or interleaved RoPE: the same tensors
    as this design's, another model. --load and the export to Hugging Face refuse it in
    one line naming the flag (they read it as unscaled, rotate-half RoPE)."""
    from megatron.training.checkpointing import iteration_dir, read_common
    from tests.test_checkpointing import _convert_tool_main

    root = tmp_path / "ckpt"
    shutil.copytree(MCORE019, root)
    common = read_common(iteration_dir(MCORE019, ITERATION))
    plain = {k: v for k, v in vars(common["args"]).items()  # what pickles outside 0.19
             if isinstance(v, (bool, int, float, str, type(None)))}
    common["args"] = types.SimpleNamespace(**{**plain, flag: value})
    torch.save(common, root / f"iter_{ITERATION:07d}" / "common.pt")
    with pytest.raises(SystemExit) as exit_:
        main([*FLAGS, "--load", str(root), "--data-cache-path", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert f"the checkpoint was saved with {flag} True (this model computes False)" in err[0]
    code = _convert_tool_main()(["--from", "megatron", "--to", "hf", "--input", str(root),
                                 "--output", str(tmp_path / "hf")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"saved with {flag} True (this model computes False)" in lines[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.skipif(not os.environ.get("MEGATRON_CORE_019_PYTHON"),
                    reason="set MEGATRON_CORE_019_PYTHON to a Python with megatron-core 0.19.2 "
                           "(see tests/fixtures/make_mcore019_checkpoint.py)")
def test_megatron_lm_0_19_resumes_our_checkpoint(tmp_path, one_process):
    """Megatron-LM 0.19 loads our checkpoint with --use-checkpoint-args and no model flags:
    our args rebuild the model, its iteration, samples and scheduler are ours, and its
    GPTModel's logits equal megatron-core 0.16's GPTModel's on the same weights."""
    ckpt, cache = tmp_path / "ckpt", str(tmp_path / "cache")
    train(parse_args([*FLAGS, "--train-iters", "2", "--lr-warmup-iters", "0", "--save", str(ckpt),
                      "--data-cache-path", cache]), one_process)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    result = subprocess.run(
        [os.environ["MEGATRON_CORE_019_PYTHON"], os.path.join(FIXTURES, "read_with_mcore019.py"),
         str(ckpt), str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    assert (theirs["iteration"], theirs["consumed_train_samples"], theirs["num_steps"]) == \
        (2, 2 * BATCH, 2 * BATCH)
    assert theirs["args"] == {
        "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 160, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 16, "seq_length": 32, "swiglu": True,
        "normalization": "RMSNorm", "position_embedding_type": "rope",
        "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
        "padded_vocab_size": 128}
    gpt = load_gpt_model(LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160,
                                     num_attention_heads=4, num_query_groups=2,
                                     vocab_size=128, seq_length=32, seed=1234),
                         str(ckpt / "iter_0000002"))
    mask = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        ours = gpt(tokens, torch.arange(32).expand_as(tokens), mask)
    torch.testing.assert_close(theirs["logits"], ours, rtol=0, atol=1e-5)


def test_convert_checkpoint_exports_megatron_lm_0_19s_checkpoint(tmp_path):
    """tools/convert_checkpoint.py --from megatron on 0.19's layout: the model its args
    describe, the embedding as torch.distributed.checkpoint reads it from the files."""
    import importlib.util
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(os.path.dirname(FIXTURES), "..", "tools",
                                           "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "hf"
    assert tool.main(["--from", "megatron", "--to", "hf", "--input", MCORE019,
                                    "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"]) == (2, 64, 160, 4, 2, 128)
    stored = {"embedding.word_embeddings.weight": torch.empty(128, 64)}
    dcp.load(stored, storage_reader=dcp.FileSystemReader(
        os.path.join(MCORE019, f"iter_{ITERATION:07d}")), no_dist=True)
    assert torch.equal(load_file(out / "model.safetensors")["model.embed_tokens.weight"],
                       stored["embedding.word_embeddings.weight"])


@pytest.mark.multiproc
def test_finetune_from_a_megatron_checkpoint_on_a_two_process_pipeline(tmp_path, one_process):
    """--finetune over the pipeline's version-0 parameters (it crashed: 'publish(version=0)
    ... already at 0'): iteration 1 on both processes trains the checkpoint's weights, its
    loss GPTModel's on the same batch."""
    import json

    from tests import forked_ranks

    metrics = tmp_path / "metrics.jsonl"
    argv = [*FLAGS, "--train-iters", "1", "--lr-warmup-iters", "0", "--load", MCORE019,
            "--finetune", "--data-cache-path", str(tmp_path), "--metrics-file", str(metrics)]
    result = forked_ranks.launch("pretrain_llama.py", argv, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["iteration"] == 1
    assert first["loss"] == pytest.approx(
        gpt_loss(os.path.join(MCORE019, f"iter_{ITERATION:07d}"), parse_args(argv), 1),
        abs=1e-5)


def test_a_skipped_iteration_leaves_the_lr_schedule_and_is_counted_per_log_interval(
        tmp_path, capsys, one_process):
    """fp16, iteration 2's gradient made non-finite: as Megatron, the scheduler steps only
    after updates, the logged LR and loss scale are the ones after the step, and each log
    line counts the skipped iterations since the previous one and averages the loss of
    the others."""
    argv = [*FLAGS, "--train-iters", "4", "--fp16", "--initial-loss-scale", "1024",
            "--hysteresis", "1", "--inject-overflow", "2,0,0",
            "--log-interval", "2", "--data-cache-path", str(tmp_path)]
    records = train(parse_args(argv), one_process)
    assert [r["skipped"] for r in records] == [False, True, False, False]
    # the scale after each update, as Megatron logs it: backed off by the overflow
    assert [r["loss_scale"] for r in records] == [1024, 512, 512, 512]
    updates = [1, 1, 2, 3]  # successful steps after each iteration
    assert [r["lr"] for r in records] == pytest.approx(
        [megatron_lr_after(n * BATCH, train_iters=4) for n in updates], rel=1e-12)
    lines = [line for line in capsys.readouterr().out.splitlines() if "| lm loss:" in line]  # not the summary
    assert [line.split("number of skipped iterations:")[1].split("|")[0].strip()
            for line in lines] == ["0", "1", "0"]  # iterations 1, 2 and 4
    # 0.19's means: the line after the first iteration starts no interval, a skipped
    # iteration's loss is left out
    loss = [r["loss"] for r in records]
    assert [line.split("lm loss:")[1].split("|")[0].strip() for line in lines] == [
        f"{x:.6E}" for x in (loss[0], loss[0], (loss[2] + loss[3]) / 2)]


def test_without_its_tracker_a_0_19_checkpoint_is_still_found(tmp_path):
    """0.19 writes no common.pt: its metadata.json marks the iteration complete."""
    from megatron.training.checkpointing import check_resumable

    root = tmp_path / "ckpt"
    shutil.copytree(MCORE019, root)
    (root / "latest_checkpointed_iteration.txt").unlink()
    lines = []
    common = check_resumable(parse_args([*FLAGS, "--load", str(root)]), lines.append)
    assert common["iteration"] == ITERATION
    assert lines == [f"{root}: latest_checkpointed_iteration.txt is missing; loading the "
                     f"newest complete iteration, {ITERATION}"]
