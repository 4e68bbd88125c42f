"""megatron-core reads our checkpoints and we read its, on two processes; Megatron's
auto-resume (--save D --load D) from scratch, then from its own checkpoint.

The references are megatron-core's own: its `dist_checkpointing.load` into
`GPTModel.sharded_state_dict()`, its `dist_checkpointing.save` of a GPTModel, and the
GPTModel's loss on the run's batch."""

import argparse
import multiprocessing
import os
import types

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.data.run_data import prepare_data
from megatron.data.sampling import training_micro_batches
from megatron.models.llama import LlamaConfig, LlamaModel, layer_spec, transformer_config
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, checkpoint_name
from megatron.training.checkpointing import TRACKER, iteration_dir, read_all_tensors
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import train
from tests.test_pipeline_executor import MODEL, launch, metrics

pytestmark = pytest.mark.multiproc
VOCAB = 4096  # the demo corpus tokenizer's


@pytest.fixture
def one_process():
    yield initialize_distributed()
    shutdown_distributed()


def run_config(*extra: str):
    return parse_args([*MODEL, "--data-cache-dir", os.environ["MEGATRON_TEST_CACHE"], *extra])


def model_config(run) -> LlamaConfig:
    m = run.model
    return LlamaConfig(num_layers=m.num_layers, hidden_size=m.hidden_size,
                       ffn_hidden_size=m.ffn_hidden_size,
                       num_attention_heads=m.num_attention_heads,
                       num_query_groups=m.num_query_groups, vocab_size=VOCAB,
                       seq_length=m.seq_length, seed=run.training.seed)


def gpt_model(cfg: LlamaConfig):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=transformer_config(cfg), transformer_layer_spec=layer_spec(),
                    vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                    position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).eval()


def test_megatron_core_opens_a_two_process_checkpoint_into_a_gpt_model(tmp_path, demo_cache,
                                                                       one_process):
    """One iteration at learning rate 0 on two processes (4 forward stages, d = 2): the
    saved weights are the model's initial ones (built here from the seed), and Adam's
    moments after one step are (1 - b1) g and (1 - b2) g^2."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    flags = ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
             "--eval-iters", "0",
             "--forward-stages", "4", "--backward-split", "2"]
    run = launch(tmp_path, "two", 2, *flags)
    assert run.returncode == 0, run.stderr[-4000:]
    directory = iteration_dir(str(run.out / "ckpt"), 1)
    config = run_config(*flags)
    cfg = model_config(config)

    gpt = gpt_model(cfg)
    model = gpt.sharded_state_dict()
    params = dict(gpt.named_parameters())
    moments = {prefix: {name: make_sharded_optimizer_tensor(model[name], torch.empty_like(p),
                                                            f"optimizer.state.{prefix}")
                        for name, p in params.items()}
               for prefix in ("exp_avg", "exp_avg_sq")}
    loaded = dist_checkpointing.load({"model": model, **moments}, directory)
    assert loaded["iteration"] == 1
    result = gpt.load_state_dict(loaded["model"], strict=False)
    assert not result.unexpected_keys
    assert all("_extra_state" in k for k in result.missing_keys)

    initial = {checkpoint_name(cfg, n): p for n, p in LlamaModel(cfg).named_parameters()}
    ours = read_all_tensors(directory)  # this project's own reading, by name
    b1, b2 = config.optimization.adam_beta1, config.optimization.adam_beta2
    assert sorted(params) == sorted(initial)
    for name, p in params.items():
        assert torch.equal(p, initial[name]), name
        m, v = loaded["exp_avg"][name], loaded["exp_avg_sq"][name]
        assert m.abs().max() > 0, name
        torch.testing.assert_close(v * (1 - b1) ** 2, m * m * (1 - b2), rtol=1e-5, atol=1e-20)
        for prefix, got in ((MASTER, p), (EXP_AVG, m), (EXP_AVG_SQ, v)):
            assert torch.equal(ours[prefix + name], got), prefix + name


def _megatron_core_save(state: dict, directory: str, monkeypatch) -> None:
    """dist_checkpointing.save on this CPU-only process: its writer processes report
    through a queue its code makes with a "spawn" Manager (which would re-run pytest); a
    forked one does the same here. CUDA's synchronize is a no-op without CUDA."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = multiprocessing.get_context("fork").Manager()
    try:
        monkeypatch.setattr(filesystem_async, "_results_queue", manager.Queue())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
        os.makedirs(directory)
        dist_checkpointing.save(state, directory)
    finally:
        manager.shutdown()


def test_a_megatron_core_checkpoint_loads_into_a_two_process_run(tmp_path, demo_cache,
                                                                 one_process, monkeypatch):
    """Megatron-LM's layout (iter_0000003, tracker, common state with args and its
    sample-counted scheduler, no optimizer state we can map): the run continues at
    iteration 4 with the GPTModel's weights, the schedule's LR and the data position, and
    its first loss is the GPTModel's on the same batch."""
    flags = ["--train-iters", "4", "--eval-iters", "0"]
    config = run_config(*flags)
    cfg, batch = model_config(config), config.training.global_batch_size
    torch.manual_seed(7)  # weights of its own, not the run's initial ones
    gpt = gpt_model(cfg)
    o = config.optimization
    # Megatron-LM's scheduler as its training builds it: steps count samples
    holder = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": o.weight_decay}])
    megatron_schedule = OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters * batch, lr_decay_steps=o.lr_decay_iters * batch,
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=config.training.train_iters * batch, wd_incr_style="constant")
    for _ in range(3):
        megatron_schedule.step(increment=batch)
    scheduler = megatron_schedule.state_dict()
    m = config.model
    args = argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=True,
        num_query_groups=m.num_query_groups, seq_length=m.seq_length,
        global_batch_size=batch, consumed_train_samples=3 * batch)
    root = tmp_path / "megatron"
    _megatron_core_save({"model": gpt.sharded_state_dict(), "iteration": 3, "args": args,
                         "checkpoint_version": 3.0, "opt_param_scheduler": scheduler,
                         "num_floating_point_operations_so_far": 0},
                        str(root / "iter_0000003"), monkeypatch)
    (root / TRACKER).write_text("3")

    run = launch(tmp_path, "resumed", 2, *flags, "--load", str(root))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "starts a fresh optimizer" in run.stdout
    first = metrics(run)[0]
    assert first["iteration"] == 4 and first["consumed_samples"] == 4 * batch
    megatron_schedule.step(increment=batch)  # logged after iteration 4's step, as Megatron
    assert first["lr"] == holder.param_groups[0]["lr"]

    data = prepare_data(config, log=lambda *_: None)
    micro_batches = training_micro_batches(data.datasets.train, 4, config)
    seq = cfg.seq_length
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        losses = []
        for b in micro_batches:
            positions = b.get("position_ids", torch.arange(seq).expand_as(b["tokens"]))
            per_token = gpt(b["tokens"], positions, mask, labels=b["labels"])
            losses.append(float((per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()))
    assert first["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


def test_auto_resume_starts_from_scratch_then_continues_its_own_checkpoint(
        tmp_path, demo_cache, capsys):
    """The same command twice, as a launch script resubmits it: --save D --load D, the
    first launch stopped after iteration 1 (--exit-interval, a stand-in for a time limit).
    The first says it starts from scratch, the second continues from the first's
    checkpoint (that it continues exactly is test_checkpoint_resume's subject)."""
    ckpt = str(tmp_path / "ckpt")
    command = ["--num-layers", "2", "--eval-iters", "0", "--train-iters", "2",
               "--exit-interval", "1", "--save", ckpt, "--load", ckpt]

    def launch_in_process() -> list[dict]:
        try:
            return train(run_config(*command), initialize_distributed())
        finally:
            shutdown_distributed()

    first = launch_in_process()
    assert f"no checkpoint in {ckpt}: starting from scratch (--save directory: " \
           "auto-resume" in capsys.readouterr().out
    second = launch_in_process()
    assert f"loaded checkpoint from {ckpt} at iteration 1" in capsys.readouterr().out
    assert [r["iteration"] for r in first + second] == [1, 2]
    assert second[0]["consumed_samples"] == 2 * first[0]["consumed_samples"]
