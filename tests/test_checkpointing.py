"""Checkpoints in one process: the layout, lossless round trips, saving in the background,
a kill mid-write, the old formats, a full disk, the load flags and auto-resume."""


import os
import textwrap
import threading
import time

import pytest
import torch

import megatron.training.checkpointing as checkpointing
from megatron.config.presets import get_preset
from megatron.models.llama import LlamaConfig
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, OwnedState
from megatron.training.checkpointing import (
    TRACKER,
    CheckpointError,
    CheckpointSaver,
    check_resumable,
    find_checkpoint,
    iteration_dir,
    latest_iteration,
    load_checkpoint,
    read_all_tensors,
)
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import main
from tests import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model(vocab_size: int = 100) -> LlamaConfig:
    return LlamaConfig(num_layers=2, hidden_size=10, ffn_hidden_size=16, num_attention_heads=2,
                       num_query_groups=1, vocab_size=vocab_size, seq_length=8)


MODEL = model()


@pytest.fixture(autouse=True)
def process_group():
    """megatron-core's sharded layout needs its process groups (main() makes its own)."""
    initialize_distributed()
    yield
    shutdown_distributed()


def owned(seed: int, cfg: LlamaConfig = MODEL) -> OwnedState:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    # (one process holds every layer of a stacked key: torch's ShardedTensor, which
    # megatron-core uses for them, places the others on another rank)
    for name, shape in (("embedding.word_embeddings.weight", (cfg.vocab_size, cfg.hidden_size)),
                        ("decoder.layers.0.input_layernorm.weight", (cfg.hidden_size,)),
                        ("decoder.layers.1.input_layernorm.weight", (cfg.hidden_size,))):
        for prefix in (MASTER, EXP_AVG, EXP_AVG_SQ):
            tensors[prefix + name] = torch.randn(shape, generator=g)
    return OwnedState(tensors, optimizer_step=seed, loss_scaler={"scale": 2.0**seed})


def empty_like(state: OwnedState) -> OwnedState:
    return OwnedState({k: torch.full_like(v, float("nan")) for k, v in state.tensors.items()},
                      0, None)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_saved_state_loads_back_bit_for_bit_in_megatrons_layout(tmp_path, async_save):
    root = str(tmp_path)
    saver = CheckpointSaver(root, MODEL, async_save=async_save, log=lambda *_: None)
    first, second = owned(3), owned(6)
    saver.save(3, first, {"lr_schedule": {"num_steps": 3}})
    saver.save(6, second, {"lr_schedule": {"num_steps": 6}})
    saver.close()
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000006", TRACKER]
    assert (tmp_path / TRACKER).read_text() == "6"
    assert sorted(os.listdir(iteration_dir(root, 6))) == [
        ".metadata", "__0_0.distcp", "checksums.json", "common.pt", "metadata.json"]
    target = empty_like(second)
    common = load_checkpoint(root, target, MODEL)
    assert common["iteration"] == 6 and common["optimizer_step"] == 6
    assert common["lr_schedule"] == {"num_steps": 6} and common["loss_scaler"] == {"scale": 64.0}
    for key, tensor in second.tensors.items():
        assert torch.equal(target.tensors[key], tensor), key
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


def test_finetune_reads_the_weights_and_zeroes_the_moments(tmp_path):
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=False)
    saver.save(2, owned(2), {})
    saver.close()
    target = empty_like(owned(2))
    load_checkpoint(str(tmp_path), target, MODEL, finetune=True)
    for key, tensor in owned(2).tensors.items():
        want = tensor if key.startswith(MASTER) else torch.zeros_like(tensor)
        assert torch.equal(target.tensors[key], want), key


@pytest.mark.parametrize("weights_only", [True, False])
def test_without_optimizer_state_or_with_no_load_optim_the_run_starts_a_fresh_optimizer(
        tmp_path, weights_only):
    saved = owned(1)
    if weights_only:
        saved = OwnedState({k: v for k, v in saved.tensors.items() if k.startswith(MASTER)},
                           1, None)
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=False)
    saver.save(3, saved, {})
    saver.close()
    target, lines = empty_like(owned(1)), []
    common = load_checkpoint(str(tmp_path), target, MODEL, load_optim=weights_only,
                             log=lines.append)
    assert common["iteration"] == 3 and common["optimizer_step"] == 0
    for key, tensor in owned(1).tensors.items():
        want = tensor if key.startswith(MASTER) else torch.zeros_like(tensor)
        assert torch.equal(target.tensors[key], want), key
    assert len(lines) == weights_only  # said once when the checkpoint lacks the state
    assert all("starts a fresh optimizer" in line for line in lines)


def test_the_async_save_returns_before_the_write_and_the_next_save_waits(tmp_path, monkeypatch):
    """Training is blocked by the snapshot only; we compare that time with a synchronous
    save of the same state (reported, not asserted: timings are not tested)."""
    big = model(vocab_size=100_000)
    state = owned(1, big)  # 24 MB of masters and moments
    sync = CheckpointSaver(str(tmp_path / "sync"), big, async_save=False)
    sync_s = sync.save(1, state, {})
    sync.close()

    release = threading.Event()
    real_commit = checkpointing._commit

    def held_commit(*args):
        release.wait(timeout=60)
        real_commit(*args)

    monkeypatch.setattr(checkpointing, "_commit", held_commit)
    saver = CheckpointSaver(str(tmp_path / "async"), big, async_save=True)
    blocked_s = saver.save(1, state, {})
    print(f"\nblocked by the async save: {blocked_s:.4f} s; synchronous save: {sync_s:.4f} s")
    # The write is still in flight, and changing the live tensors cannot reach it.
    assert latest_iteration(str(tmp_path / "async")) is None
    for tensor in state.tensors.values():
        tensor.add_(1.0)
    release.set()
    saver.close()
    got = read_all_tensors(iteration_dir(str(tmp_path / "async"), 1))
    for key, tensor in state.tensors.items():
        assert torch.equal(got[key] + 1.0, tensor), key


NORM = MASTER + "decoder.final_layernorm.weight"
KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, sys.argv[3])  # the repository
    from megatron.training.distributed import initialize_distributed
    initialize_distributed()
    import megatron.training.checkpointing as c
    from megatron.training.checkpoint_state import OwnedState
    from megatron.models.llama import LlamaConfig
    MODEL = LlamaConfig(num_layers=2, hidden_size=10, ffn_hidden_size=16, num_attention_heads=2,
                        num_query_groups=1, vocab_size=100, seq_length=8)
    root = sys.argv[1]
    state = lambda v: OwnedState({"model.decoder.final_layernorm.weight": torch.full((10,), v)},
                                 1, None)
    saver = c.CheckpointSaver(root, MODEL, async_save=True)
    saver.save(1, state(1.0), {})
    saver.wait()
    def never_commits(*args):
        open(sys.argv[2], "w").close()  # iteration 2's shard is written
        time.sleep(120)
    c._commit = never_commits
    saver.save(2, state(2.0), {})
    time.sleep(120)
""")


@pytest.mark.multiproc
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    root, writing = str(tmp_path / "ckpt"), tmp_path / "writing"
    script = tmp_path / "killed_writer.py"
    script.write_text(KILLED_WRITER)
    # a process of its own, forked from the session's preloaded zygote (tests/forked_ranks.py:
    # no second torch import), killed with SIGKILL as iteration 2's commit is due
    job = forked_ranks.start(str(script), [root, str(writing), ROOT])
    try:
        deadline = time.monotonic() + 120
        while not writing.exists() and job.running() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        job.kill()
        killed = job.wait()
    assert writing.exists(), killed.stderr[-3000:]  # iteration 2's shard is written
    assert os.path.isdir(iteration_dir(root, 2) + ".tmp")
    target = OwnedState({NORM: torch.zeros(10)}, 0, None)
    assert load_checkpoint(root, target, MODEL, finetune=True)["iteration"] == 1
    assert torch.equal(target.tensors[NORM], torch.full((10,), 1.0))
    # The next save removes what the killed one left.
    saver = CheckpointSaver(root, MODEL, async_save=False)
    saver.save(3, target, {})
    saver.close()
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000003", TRACKER]


def test_the_old_per_rank_format_is_refused_in_one_line(tmp_path):
    os.makedirs(iteration_dir(str(tmp_path), 4))
    torch.save({"train_step": {}}, os.path.join(iteration_dir(str(tmp_path), 4), "rank_000.pt"))
    (tmp_path / TRACKER).write_text("4")
    with pytest.raises(CheckpointError, match="old per-rank format") as error:
        load_checkpoint(str(tmp_path), owned(1), MODEL)
    assert "\n" not in str(error.value)


def test_a_bad_tracker_is_reported(tmp_path):
    (tmp_path / TRACKER).write_text("two")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        latest_iteration(str(tmp_path))


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing.shutil, "disk_usage",
                        lambda path: _Usage(free=1000))
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=True)
    with pytest.raises(CheckpointError, match=r"--save .*needs .* MiB, 0\.0 MiB free"):
        saver.save(1, owned(1), {})
    saver.close()
    assert os.listdir(tmp_path) == []


class _Usage:
    def __init__(self, free):
        self.free = free


def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpointing.dcp, "save", broken)
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=True)
    saver.save(1, owned(1), {})
    time.sleep(0.1)
    with pytest.raises(CheckpointError, match="No space left"):
        saver.save(2, owned(2), {})
    saver.close()
    assert latest_iteration(str(tmp_path)) is None


def test_without_host_memory_for_the_snapshot_the_save_runs_synchronously(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(checkpointing, "available_host_memory", lambda: 1000)
    lines = []
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=True, log=lines.append)
    saver.save(1, owned(1), {})
    assert latest_iteration(str(tmp_path)) == 1  # written before save() returned
    saver.close()
    assert any("saving synchronously" in line for line in lines)


def test_a_checkpoint_of_another_global_batch_is_refused_before_anything_is_built(tmp_path):
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=False)
    saver.save(3, owned(3), {"consumed_samples": 3 * 8, "lr_schedule": {"num_steps": 3 * 8}})
    saver.close()
    run = parse_args(["--model-preset", "tiny", "--load", str(tmp_path),
                      "--global-batch-size", "8"])
    check_resumable(run)
    run = run.evolve(training={"global_batch_size": 16})
    with pytest.raises(CheckpointError, match="expected --global-batch-size 8 .not 16."):
        check_resumable(run)
    run = run.evolve(checkpointing={"finetune": True})  # weights only: the data starts over
    check_resumable(run)


def test_pretrain_llama_refuses_the_old_format_in_one_line_with_exit_2(tmp_path, capsys):
    legacy = iteration_dir(str(tmp_path), 4)
    os.makedirs(legacy)
    torch.save({"train_step": {}}, os.path.join(legacy, "rank_000.pt"))
    (tmp_path / TRACKER).write_text("4")
    with pytest.raises(SystemExit) as exit_:
        main(["--model-preset", "tiny", "--load", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old per-rank format" in err[0] and legacy in err[0]


def test_without_a_tracker_or_with_a_stale_one_the_newest_complete_iteration_loads(tmp_path):
    root = str(tmp_path)
    saver = CheckpointSaver(root, MODEL, async_save=False)
    saver.save(1, owned(1), {})
    saver.save(2, owned(2), {})
    saver.close()
    os.makedirs(iteration_dir(root, 3) + ".tmp")  # a save killed mid-write is not complete
    (tmp_path / TRACKER).unlink()
    lines, target = [], empty_like(owned(2))
    assert load_checkpoint(root, target, MODEL, log=lines.append) is not None
    assert torch.equal(target.tensors[MASTER + "embedding.word_embeddings.weight"],
                       owned(2).tensors[MASTER + "embedding.word_embeddings.weight"])
    assert find_checkpoint(root) == (iteration_dir(root, 2), f"{root}: {TRACKER} is missing; "
                                     "loading the newest complete iteration, 2")
    (tmp_path / TRACKER).write_text("5")  # names an iteration that is not there
    assert find_checkpoint(root)[0] == iteration_dir(root, 2)
    assert "names iteration 5, whose directory is missing" in find_checkpoint(root)[1]
    # --load DIR/iter_0000001: that iteration
    assert find_checkpoint(iteration_dir(root, 1)) == (iteration_dir(root, 1), None)
    target = empty_like(owned(1))
    assert load_checkpoint(iteration_dir(root, 1), target, MODEL)["iteration"] == 1
    assert torch.equal(target.tensors[EXP_AVG + "embedding.word_embeddings.weight"],
                       owned(1).tensors[EXP_AVG + "embedding.word_embeddings.weight"])


def test_this_projects_first_format_still_loads(tmp_path):
    """Plain DCP, every tensor whole under its OwnedState key, no metadata.json."""
    import torch.distributed.checkpoint as dcp

    saved = owned(4)
    directory = iteration_dir(str(tmp_path), 4)
    dcp.save(saved.tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    torch.save({"iteration": 4, "optimizer_step": 4, "format_version": 1},
               os.path.join(directory, "common.pt"))
    (tmp_path / TRACKER).write_text("4")
    target = empty_like(saved)
    assert load_checkpoint(str(tmp_path), target, MODEL)["optimizer_step"] == 4
    for key, tensor in saved.tensors.items():
        assert torch.equal(target.tensors[key], tensor), key


def test_use_checkpoint_args_takes_the_model_flags_from_the_checkpoint(tmp_path):
    """Megatron-LM's meaning: the recorded flags fill those not given (no --num-layers
    needed), a given size stays, the forced ones (query groups, rotary) are the
    checkpoint's."""
    saved = parse_args(["--model-preset", "tiny", "--num-layers", "2",
                        "--group-query-attention", "--num-query-groups", "2",
                        "--rotary-base", "500000", "--make-vocab-size-divisible-by", "1"])
    saver = CheckpointSaver(str(tmp_path), MODEL, async_save=False)
    saver.save(1, owned(1), {"args": saved.flags()})
    saver.close()
    load = ["--load", str(tmp_path), "--use-checkpoint-args"]
    alone = parse_args(load).model
    assert (alone.num_layers, alone.hidden_size, alone.num_query_groups, alone.rotary_base) \
        == (2, saved.model.hidden_size, 2, 500000)
    # the vocabulary padded as the checkpoint's was (a converted model's rows, divisor 1)
    assert alone.make_vocab_size_divisible_by == 1
    given = parse_args([*load, "--num-layers", "6", "--group-query-attention",
                        "--num-query-groups", "4", "--make-vocab-size-divisible-by", "64"]).model
    assert (given.num_layers, given.num_query_groups) == (6, 2)
    assert given.make_vocab_size_divisible_by == 64
    assert parse_args(["--model-preset", "tiny", "--load", str(tmp_path)]).model.num_layers \
        == get_preset("tiny").num_layers


@pytest.mark.parametrize("argv,fragment", [
    (["--ckpt-format", "torch"], "--ckpt-format torch: expected torch_dist"),
    (["--save", "{d}", "--load", "{d}", "--exit-on-missing-checkpoint"],
     "--load {d}: expected an existing checkpoint directory (--exit-on-missing-checkpoint)"),
    (["--load", "{d}"], "--load {d}: expected an existing checkpoint directory"),
])
def test_bad_checkpoint_flags_exit_2_in_one_line(tmp_path, capsys, argv, fragment):
    d = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as exit_:
        main(["--model-preset", "tiny", *(a.format(d=d) for a in argv)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment.format(d=d) in err[0]
    assert not os.path.exists(d)


def _convert_tool_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("damage,fragment", [
    (lambda data: data[:len(data) // 2], "bytes, expected"),  # truncated
    (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], "damaged (CRC-32"),
])
def test_a_damaged_or_truncated_file_is_named_in_one_line_with_exit_2(tmp_path, capsys,
                                                                       damage, fragment):
    root = str(tmp_path / "ckpt")
    saver = CheckpointSaver(root, MODEL, async_save=False)
    saver.save(1, owned(1), {})
    saver.close()
    shard = os.path.join(iteration_dir(root, 1), "__0_0.distcp")
    with open(shard, "rb") as f:
        data = f.read()
    with open(shard, "wb") as f:
        f.write(damage(data))
    with pytest.raises(CheckpointError, match=fragment.replace("(", r"\(")) as error:
        load_checkpoint(root, empty_like(owned(1)), MODEL)
    assert str(error.value).startswith(shard) and "\n" not in str(error.value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # before anything is built
        main(["--model-preset", "tiny", "--load", root])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard in err[0] and fragment in err[0]
    initialize_distributed()  # main() shut its group down
    code = _convert_tool_main()(["--from", "megatron", "--to", "hf", "--input", root,
                                 "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and shard in err[0] and fragment in err[0]
    assert not (tmp_path / "hf").exists()


def test_exit_on_missing_checkpoint_refuses_an_empty_load_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model-preset", "tiny", "--load", str(tmp_path), "--exit-on-missing-checkpoint"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--load {tmp_path}: holds no checkpoint" in err[0]
    assert os.listdir(tmp_path) == []
