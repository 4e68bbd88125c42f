"""What a newcomer sees in the first hour: progress only on a terminal, the summary a run
ends with, figures printed with their digits, examples that keep to their own files."""

import io
import os
import re

import pytest

from megatron.common.progress import Progress, progress_enabled, say_starting
from megatron.training.arguments import parse_args
from megatron.training.metrics import format_tflops
from megatron.training.run_summary import RunOutcome, format_run_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_forcing(monkeypatch):
    monkeypatch.delenv("MEGATRON_SYSX_PROGRESS", raising=False)
    monkeypatch.delenv("CI", raising=False)


def draw(stream, total=None) -> str:
    with Progress("reading", total=total, unit="files", stream=stream) as progress:
        progress.start -= 1  # as if a second had passed: the first redraw is due
        progress._last -= 1
        progress.update(3)
    say_starting("setup: data ...", stream)
    return stream.getvalue()


def test_progress_draws_a_bar_on_a_terminal(no_forcing):
    out = draw(Terminal(), total=10)
    assert "\rreading [#######-----------------] 3/10 files" in out
    assert out.endswith("\nsetup: data ...\n")


def test_progress_is_silent_in_a_file_a_pipe_and_ci(no_forcing, monkeypatch):
    assert draw(io.StringIO(), total=10) == ""
    monkeypatch.setenv("CI", "true")
    assert draw(Terminal(), total=10) == ""
    monkeypatch.setenv("MEGATRON_SYSX_PROGRESS", "1")  # forced on, even in CI
    assert progress_enabled(io.StringIO())


def test_progress_without_a_size_counts_with_a_rate(no_forcing):
    out = draw(Terminal())
    assert re.search(r"\rreading 3 files \([\d.]+/s\) [\d.]+ s", out), out


def test_small_throughputs_keep_their_digits():
    assert format_tflops(0.0123) == "0.0123"
    assert format_tflops(123.45) == "123.5"  # Megatron's one decimal where it shows


def records(losses):
    return [{"iteration": i, "loss": loss, "iter_time_s": 0.5, "skipped": False,
             "skipped_total": 0} for i, loss in enumerate(losses, start=1)]


def test_the_summary_names_iterations_losses_time_and_every_output(tmp_path):
    run = parse_args(["--model-preset", "tiny", "--train-iters", "3",
                      "--metrics-file", "runs/x/m.jsonl", "--timeline", "runs/x/t.png",
                      "--trace", "runs/x/t.json", "--save", str(tmp_path / "ck")])
    text = format_run_summary(run, RunOutcome(records([8.5, 7.25, 7.5]), 0, None, 3, 12.0,
                                              pipeline=True))
    head, *outputs = text.splitlines()
    assert head == ("run summary: iterations 1-3 of 3, 12.0 s from set-up to the end (1.5 s "
                    "of it in iterations); final lm loss 7.500000E+00, best 7.250000E+00 at "
                    "iteration 2")
    assert [line.split()[0] for line in outputs] == ["metrics:", "timeline:", "trace:",
                                                     "checkpoint:"]
    assert "runs/x/t.png (the measured iteration 3)" in outputs[1]
    assert f"{tmp_path / 'ck' / 'iter_0000003'} (the latest" in outputs[3]


def test_the_summary_of_one_process_says_it_drew_no_timeline():
    run = parse_args(["--model-preset", "tiny", "--timeline", "t.png"])
    text = format_run_summary(run, RunOutcome(records([9.0]), 0, "--exit-interval 1", None,
                                              75.0, pipeline=False))
    assert "stopped early: --exit-interval 1" in text and "0:01:15" in text
    assert "t.png (not written: one process runs no pipeline to record)" in text


def test_the_cpu_example_writes_its_own_run_directory():
    with open(os.path.join(ROOT, "examples", "train_tiny_cpu.sh")) as f:
        text = f.read()
    outputs = re.findall(r"--(?:metrics-file|timeline|trace) (\S+)", text)
    assert len(outputs) == 3
    assert all(path.startswith("runs/tiny-cpu-example/") for path in outputs), outputs


def test_the_megatron_example_finds_the_projects_torchrun_and_says_how_otherwise():
    with open(os.path.join(ROOT, "examples", "megatron_llama2_launch.sh")) as f:
        text = f.read()
    assert "[ -x .venv/bin/torchrun ]" in text and "make setup" in text
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/tensorboard_logs/" in f.read().split()  # the example's default log path


def test_the_timeline_says_its_unit_and_what_its_labels_mean(tmp_path):
    from megatron.schedules.timeline import (
        TimedEvent,
        legend_text,
        time_axis,
        write_timeline_png,
    )

    events = [TimedEvent(0, "compute", 0.0, 0.002, "f0", "forward", 0, -1, 0),
              TimedEvent(0, "compute", 0.002, 0.006, "b0,1", "backward", 0, 1, 0),
              TimedEvent(0, "cpu-optimizer", 0.006, 0.009, "o0,1", "optimizer", 0, 1)]
    legend = legend_text(events)
    for text in ("fS: forward of stage S", "bS,k: backward stage k of forward stage S",
                 "oS,k: CPU optimizer step", "^m: of micro-batch m"):
        assert text in legend
    assert "prefetch" not in legend  # only the labels the picture uses
    assert time_axis(0.009, "s") == (1000.0, "time (ms)")  # measured seconds
    assert time_axis(31.5, "cost-model units")[1] == "time (cost-model units)"
    png = tmp_path / "t.png"
    write_timeline_png(events, str(png), title="measured; bubble 10.0%")
    assert png.read_bytes()[:4] == b"\x89PNG"
