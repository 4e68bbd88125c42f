"""Ctrl-C ends a run in one line, `interrupted at iteration N`, with exit status 130 and
no checkpoint of its own; a save it meets is finished first, never left half-written and
never blamed on the disk. pretrain_llama.py's main() runs in this process. (The saved
checkpoint also shows the start-up disk check's size is the real one.)"""

import os
import signal

import pytest
import torch

from megatron.common.save_lock import LOCK_NAME
from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import TRACKER
from megatron.training.run_checks import checkpoint_bytes
from megatron.training.signals import Interrupt
from megatron.training.training import main

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
         "--lr", "1e-3", "--log-interval", "1"]


def test_an_interrupt_inside_a_deferred_section_is_raised_when_it_ends():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background
    interrupt = Interrupt()
    interrupt.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                reached = True  # the body goes on
        assert reached and interrupt.received
        with pytest.raises(KeyboardInterrupt):  # outside: at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        interrupt.uninstall()
    assert signal.getsignal(signal.SIGINT) is before  # given back


@pytest.mark.multiproc  # the demo corpus
def test_ctrl_c_during_a_save_commits_it_then_ends_in_one_line(tmp_path, demo_cache, capsys,
                                                               monkeypatch):
    commit = checkpointing._commit
    before = signal.getsignal(signal.SIGINT)

    def interrupted_commit(root, iteration, *args):
        if iteration == 2:  # Ctrl-C while the checkpoint is being committed
            os.kill(os.getpid(), signal.SIGINT)
        commit(root, iteration, *args)
    monkeypatch.setattr(checkpointing, "_commit", interrupted_commit)
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as end:
        main([*SMALL, "--data-cache-dir", demo_cache, "--save", str(save),
              "--save-interval", "1", "--metrics-file", str(tmp_path / "metrics.jsonl")])
    assert end.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1:] == [
        "pretrain_llama.py: interrupted at iteration 2"]
    assert (save / TRACKER).read_text() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", TRACKER]
    assert LOCK_NAME not in os.listdir(save)  # released
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    written = sum(f.stat().st_size for f in (save / "iter_0000002").iterdir())
    vocab = torch.load(save / "iter_0000002" / "common.pt", weights_only=False)[
        "padded_vocab_size"]
    estimate = checkpoint_bytes(parse_args(SMALL), vocab)  # what the start-up check asks for
    assert written <= estimate < written + 2**20
    assert signal.getsignal(signal.SIGINT) is before  # the run gave the handler back
