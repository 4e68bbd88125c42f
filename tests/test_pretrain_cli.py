"""pretrain_llama.py as a user runs it: bad input, model size, learning, checkpoints."""

import json
import os
import shutil

import pytest

from megatron.config.model import count_parameters
from megatron.config.presets import PRESETS
from megatron.training.arguments import parse_args
from megatron.training.training import main
from tests import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--log-interval", "1"]


def run_cli(*argv, cache=None, timeout=300):
    """`python pretrain_llama.py ARGV` (a fork of the session's preloaded zygote)."""
    if cache:
        argv = (*argv, "--data-cache-dir", str(cache))
    return forked_ranks.launch("pretrain_llama.py", argv, timeout=timeout)


def run_in_process(capsys, *argv, cache=None):
    """main(ARGV) in this process, for what ends before training: (exit status, out, err)."""
    if cache:
        argv = (*argv, "--data-cache-dir", str(cache))
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def cache(demo_cache):
    return demo_cache


@pytest.mark.parametrize(
    "argv,flag,fragment",
    [
        (["--model-preset", "huge"], "--model-preset", "expected one of"),
        (["--model-preset", "tiny", "--hidden-size", "130"], "--hidden-size",
         "divisible by --num-attention-heads"),
        (["--model-preset", "tiny", "--num-attention-heads", "4", "--group-query-attention",
          "--num-query-groups", "3"],
         "--num-attention-heads", "divisible by --num-query-groups"),
        (["--model-preset", "tiny", "--micro-batch-size", "3", "--global-batch-size", "8"],
         "--global-batch-size", "multiple of --micro-batch-size"),
        (["--model-preset", "tiny", "--lr", "-1"], "--lr", ">= 0"),
        (["--num-layers", "2"], "--hidden-size", "required"),
        (["--model-preset", "tiny", "--data-path", "/nonexistent/x"], "--tokenizer-model",
         "required with --data-path"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(argv, flag, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert flag in err and fragment in err


def test_explicit_flags_override_the_preset():
    run = parse_args(["--model-preset", "tiny", "--num-layers", "3", "--lr", "0.5"])
    assert (run.model.num_layers, run.optimization.lr, run.model.hidden_size) == (3, 0.5, 128)


def test_missing_data_files_exit_2_and_name_the_path(tmp_path, cache, capsys):
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    code, _, err = run_in_process(capsys, "--model-preset", "tiny", "--data-path",
                                  str(tmp_path / "none"), "--tokenizer-model", str(tok),
                                  cache=cache)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "--data-path" in last and str(tmp_path / "none") in last


def test_unwritable_save_dir_exits_2_before_training(tmp_path, cache, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    metrics = tmp_path / "m.jsonl"
    code, _, err = run_in_process(capsys, *SMALL, "--train-iters", "2", "--save",
                                  str(blocker / "ckpt"), "--metrics-file", str(metrics),
                                  cache=cache)
    assert code == 2
    assert "--save" in err.strip().splitlines()[-1]
    assert not metrics.exists()


def test_print_model_size_reports_count_and_model_state_memory(capsys):
    code, out, err = run_in_process(capsys, "--model-preset", "10b", "--print-model-size")
    assert code == 0, err
    p = PRESETS["10b"]
    total = count_parameters(p.num_layers, p.hidden_size, p.ffn_hidden_size,
                             p.num_attention_heads, p.num_query_groups, p.vocab_size).total
    assert f"parameters: {total:,}" in out
    assert f"{total * 20 / 2**30:,.1f} GiB" in out


@pytest.fixture(scope="module")
def learning(tmp_path_factory, cache):
    """25 iterations of the tiny preset (what the loss needs to fall: see the test),
    started once the module's first test that asks for it runs (the resume test runs
    beside it)."""
    metrics = tmp_path_factory.mktemp("learn") / "metrics.jsonl"
    job = forked_ranks.start("pretrain_llama.py", [
        "--model-preset", "tiny", "--train-iters", "25", "--log-interval", "15",
        "--metrics-file", str(metrics), "--data-cache-dir", cache])
    yield metrics, job
    job.wait(timeout=300)  # gone even when no test waited for it


SAVED_FLAGS = [*SMALL, "--lr", "1e-3", "--lr-warmup-iters", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cache):
    """6 iterations saved every 3 (the uninterrupted run of the resume test), once for the
    tests that load a checkpoint: (its result, its --save, its metrics file)."""
    out = tmp_path_factory.mktemp("saved")
    ckpt, full = out / "ckpt", out / "full.jsonl"
    first = run_cli(*SAVED_FLAGS, "--train-iters", "6", "--save", str(ckpt),
                    "--save-interval", "3", "--metrics-file", str(full), cache=cache)
    assert first.returncode == 0, first.stderr[-2000:]
    return first, ckpt, full


def test_resume_from_checkpoint_continues_the_same_run(tmp_path, cache, learning, saved):
    part = tmp_path / "part.jsonl"
    common = [*SAVED_FLAGS, "--train-iters", "6"]
    # The uninterrupted run is the reference; its saves do not change its training.
    first, saved_ckpt, full = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_ckpt, ckpt)  # the saved run stays whole for the other tests
    # Keep only the iteration-3 checkpoint, as if the first run had died after it.
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    r = run_cli(*common, "--load", str(ckpt), "--metrics-file", str(part), cache=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = read_metrics(part)
    assert [row["iteration"] for row in resumed] == [4, 5, 6]
    # each run ends saying what it trained and where its files went
    assert (f"checkpoint:  {saved_ckpt}/iter_0000006 (the latest in {saved_ckpt}"
            in first.stdout)
    assert f"metrics:     {full} " in first.stdout
    assert "run summary: iterations 4-6 of 6" in r.stdout
    reference = {row["iteration"]: row for row in read_metrics(full)}
    for row in resumed:
        assert row["loss"] == pytest.approx(reference[row["iteration"]]["loss"], rel=1e-6)
        assert row["lr"] == pytest.approx(reference[row["iteration"]]["lr"], rel=1e-12)
    assert not list(ckpt.glob("*.tmp")) and not list(saved_ckpt.glob("*.tmp"))
    assert "not bit for bit" not in r.stdout  # the same flags: nothing to say


def test_tiny_preset_learns_on_the_builtin_corpus(learning):
    metrics, job = learning
    r = job.wait(timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "lm loss" in r.stdout and "tokens per second" in r.stdout
    rows = read_metrics(metrics)
    assert [row["iteration"] for row in rows] == list(range(1, 26))
    for key in ("iteration", "loss", "lr", "iter_time_s", "tokens_per_s"):
        assert key in rows[0]
    # a mean: one batch's loss is noisy. The tiny preset on the demo corpus falls from 8.3
    # to about 6.6 in 25 iterations, then slowly.
    last = [row["loss"] for row in rows[-5:]]
    assert sum(last) / len(last) < 0.85 * rows[0]["loss"]
    best = min(rows, key=lambda row: row["loss"])
    assert (f"final lm loss {rows[-1]['loss']:.6E}, best {best['loss']:.6E} at iteration "
            f"{best['iteration']}") in r.stdout
    assert f"metrics:     {metrics} (one JSON object per iteration)" in r.stdout


# --- faults a user meets: progress lost, sizes, messages ------------------------------------

def test_exit_interval_without_save_says_nothing_will_be_saved_and_stops(tmp_path, cache):
    r = run_cli(*SMALL, "--train-iters", "4", "--exit-interval", "2", cache=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--exit-interval 2 without --save" in warnings[0]
    assert "nothing will be saved" in warnings[0]
    assert "exiting program at iteration 2 (after iteration 2: --exit-interval 2 reached)" \
        in r.stdout  # Megatron-LM 0.19's words first


def test_train_iters_below_the_checkpoint_ends_normally_saying_so(tmp_path, cache, saved):
    _, ckpt, _ = saved  # at iteration 6
    metrics = tmp_path / "again.jsonl"
    r = run_cli(*SMALL, "--train-iters", "2", "--load", str(ckpt),
                "--metrics-file", str(metrics), cache=cache)
    assert r.returncode == 0, r.stderr[-2000:]  # as Megatron: the loop does not run
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, r.stderr
    assert f"{ckpt} is already at iteration 6 >= --train-iters 2" in warnings[0]
    assert not metrics.exists() or not metrics.read_text()


@pytest.mark.parametrize("argv,advice", [
    (["--num-layers", "200", "--hidden-size", "8192", "--ffn-hidden-size", "22016",
      "--num-attention-heads", "64", "--group-query-attention",
      "--num-query-groups", "8"], "a smaller model"),
    (["--seq-length", "1000000"], "a smaller --micro-batch-size or --seq-length"),
    (["--vocab-size", "1000000000"], "a smaller model"),
    (["--micro-batch-size", "100000", "--global-batch-size", "100000"],
     "a smaller --micro-batch-size"),
])
def test_a_one_process_run_that_cannot_fit_is_refused_before_allocating(argv, advice, tmp_path,
                                                                       cache, capsys):
    """The pipeline's fit check, for one process: one line naming what it needs and what
    is available, instead of allocating until a traceback or the OOM killer."""
    metrics = tmp_path / "m.jsonl"
    code, out, err = run_in_process(capsys, *SMALL, *argv, "--train-iters", "1",
                                    "--metrics-file", str(metrics), cache=cache)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "host memory: the one-process run would need" in lines[0]
    assert "available (" in lines[0] and "short)" in lines[0] and advice in lines[0]
    assert not metrics.exists()


def test_a_layout_larger_than_the_processes_started_names_both(cache):
    """DP 2 x PP 2 on 2 processes: the message used to say 1 process was started."""
    r = forked_ranks.launch("pretrain_llama.py", [
        *SMALL, "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
        "--data-cache-dir", cache], 2, timeout=300)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, r.stderr[-2000:]  # rank 0 only
    assert "2 processes were started" in lines[0] and "--data-parallel-size 2" in lines[0]
    assert "2 x 2 = 4" in lines[0] and "--nproc-per-node 4" in lines[0]


def test_a_binary_schedule_file_is_one_line_naming_it(tmp_path, cache, capsys):
    path = tmp_path / "s.csv"
    path.write_bytes(bytes(range(128, 256)))
    code, _, err = run_in_process(capsys, *SMALL, "--schedule-file", str(path), cache=cache)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"--schedule-file {path}" in lines[0] and "is not a UTF-8 CSV" in lines[0]


@pytest.mark.parametrize("async_save", ["--async-save", "--no-async-save"])
def test_a_save_the_file_system_refuses_is_one_line(async_save, tmp_path, cache):
    """The checkpoint's staging directory cannot be created (a file is in its way): one
    line naming --save and the cause, not a traceback; exit 1 (a fault mid-run)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000001.tmp").write_text("in the way")
    r = run_cli(*SMALL, "--train-iters", "1", "--save", str(ckpt), async_save, cache=cache)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, r.stderr[-3000:]
    assert f"--save {ckpt}: writing the checkpoint" in errors[0] and "File exists" in errors[0]


def test_two_jobs_with_the_same_run_id_the_second_is_one_line(tmp_path, cache):
    """Two jobs started with the same --rdzv-id (TORCHELASTIC_RUN_ID) on one node: the
    second finds the first's live segments and stops in one line, exit 2. The first is
    paused (SIGSTOP) once every rank of it trains: its processes, and so its segments,
    stay alive, and its iterations no longer take the cores the second starts on."""
    import signal
    import time
    import uuid

    from megatron.offload.param_store import job_segments
    run_id = f"same-{uuid.uuid4().hex}"
    env = {"TORCHELASTIC_RUN_ID": run_id}
    flags = [*SMALL, "--data-cache-dir", cache]
    trained = tmp_path / "first.jsonl"
    first = forked_ranks.start("pretrain_llama.py", [*flags, "--train-iters", "5000",
                                                     "--metrics-file", str(trained)], 2,
                               env=env)
    try:
        deadline = time.monotonic() + 240
        # an iteration logged: every rank has created its segments
        while not (trained.exists() and trained.read_text().endswith("\n")):
            assert first.running() and time.monotonic() < deadline
            time.sleep(0.05)
        for pid in first.pids:
            os.kill(pid, signal.SIGSTOP)
        assert job_segments(f"run:{run_id}")
        second = forked_ranks.launch("pretrain_llama.py", [*flags, "--train-iters", "1"], 2,
                                     env=env, timeout=240)
    finally:
        for pid in first.pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a paused process acts on SIGTERM once resumed
        first.wait(timeout=120)
    assert second.returncode != 0, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines()  # the launcher's own lines aside
              if line.strip() and not line.startswith("[forked_ranks]")]
    assert "exit status 2" in second.stderr  # every rank stopped with bad input
    assert len(errors) == 1, second.stderr[-3000:]
    assert "another job with the same job id" in errors[0] and "--rdzv-id" in errors[0]
    assert forked_ranks.segments_left(f"run:{run_id}") == []


def test_a_save_dir_without_room_for_a_checkpoint_is_refused_at_start(tmp_path, cache,
                                                                      capsys):
    """Checked at start, not at the first save after training: a model whose checkpoint
    (12 bytes per parameter) cannot fit the file system of --save. Nothing is created."""
    save = tmp_path / "new" / "ckpt"
    code, _, err = run_in_process(capsys, *SMALL, "--vocab-size", str(10**11),
                                  "--save", str(save), cache=cache)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"--save {save}" in lines[0] and "a checkpoint of this model needs at least" in lines[0]
    assert "TiB" in lines[0] and "free" in lines[0]
    assert not (tmp_path / "new").exists()


def test_an_error_after_the_output_checks_leaves_no_empty_directories(tmp_path, cache,
                                                                      capsys):
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    out = tmp_path / "out"
    code, _, err = run_in_process(capsys, *SMALL, "--save", str(out / "ckpt"),
                                  "--tensorboard-dir", str(out / "tb"),
                                  "--metrics-file", str(out / "logs" / "m.jsonl"),
                                  "--data-path", str(tmp_path / "none"),
                                  "--tokenizer-model", str(tok), cache=cache)
    assert code == 2
    assert "--data-path" in err.strip().splitlines()[-1]
    assert not out.exists()  # the checks passed without creating them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]


def test_a_start_removes_what_dead_runs_left_in_shared_memory_and_says_so(
        capsys, private_shm_dir):
    """A segment of another run id whose creator is dead (its worker and reaper were
    killed) is removed by the sweep a pipeline's start runs first (pipeline_step), which
    says how much. The sweep runs on a directory of its own: in /dev/shm any other start
    on the machine (the suite's other session) could remove the segment first."""
    import struct
    import subprocess
    import uuid

    from megatron.offload.shm_header import MAGIC
    from megatron.pipeline.node_memory import sweep_left_behind
    dead = subprocess.Popen(["true"])
    dead.wait()
    path = os.path.join(private_shm_dir, f"mlm-{uuid.uuid4().hex[:12]}-n0-s0-0")
    with open(path, "wb") as f:  # what a SIGKILLed worker leaves: a complete segment
        f.write(MAGIC + struct.pack("<6q", 3, 0, dead.pid, 12345, 16, 3)
                + bytes(4096 - 56 + 32))
    sweep_left_behind(private_shm_dir)
    out = capsys.readouterr().out
    assert not os.path.exists(path)
    assert ("removed 1 shared-memory segment(s) (" in out
            and f"left by dead processes from {private_shm_dir}" in out)


def test_a_pipeline_says_what_slows_it_and_keeps_the_lock_of_a_save_directory_removed(
        tmp_path, cache, capsys, monkeypatch):
    """One run for two things a user meets (a run is the costly part):
    - a locked-memory limit smaller than what a process page-locks (on the CPU device
      layer a stand-in for ulimit -l): the start-up line names the limit, what the run
      pins, the cost and the fix, and the run summary says it again;
    - the --save directory removed after the first checkpoint (a cleanup script): the next
      save takes the recreated directory's lock again and says so once; the run ends
      normally with its checkpoint and no lock left behind."""
    from megatron.common.save_lock import LOCK_NAME
    from megatron.training import checkpointing

    save = tmp_path / "ckpt"
    commit = checkpointing._commit

    def commit_then_remove(root, iteration, *args):
        commit(root, iteration, *args)
        if iteration == 1:
            shutil.rmtree(root)
    monkeypatch.setattr(checkpointing, "_commit", commit_then_remove)
    monkeypatch.setenv("MEGATRON_CPU_DEVICE_MEMLOCK", "64KiB")
    code, out, err = run_in_process(capsys, *SMALL, "--train-iters", "2",
                                    "--pipeline-schedule", "decoupled", "--save", str(save),
                                    "--save-interval", "1", cache=cache)
    assert code in (0, None), err
    pinned, removed = err.strip().splitlines()
    assert pinned.startswith("pretrain_llama.py: warning: pinned memory: a process of this "
                             "run page-locks ")
    assert ("MEGATRON_CPU_DEVICE_MEMLOCK allows 64.00 KiB: at least " in pinned
            and pinned.endswith("`ulimit -l unlimited` before the launch, or `docker run "
                                "--ulimit memlock=-1`"))
    summary = out[out.index("run summary:"):].splitlines()
    assert summary[-1].startswith("  pinned:      at least ") and "stayed pageable " \
        "(MEGATRON_CPU_DEVICE_MEMLOCK 64.00 KiB)" in summary[-1]
    assert removed == (
        f"pretrain_llama.py: warning: --save {save}: the directory (or its lock) was removed "
        "during the run; recreated it and took its lock again (the checkpoints saved before "
        "went with it)")
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert LOCK_NAME not in os.listdir(save)
