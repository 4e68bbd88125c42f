"""examples/slurm_pretrain_llama.sbatch under a real Slurm (a one-node cluster on localhost,
tests/slurm_cluster.py): the job is signalled as Slurm signals it before a time limit
(SIGUSR1 to the batch shell only, what `--signal=B:USR1@120` sends), every rank saves the
iteration it was in, the script requeues the job, and the requeued run continues with the
losses of an uninterrupted run. Two CPU processes play the node's GPUs. Skipped where Slurm
cannot be installed or started (not root, no slurm-wlm/munge)."""

import json
import os
import sys
import time

import pytest

from megatron.offload.naming import job_prefix, resolve_job_id
from megatron.training.checkpointing import TRACKER, iteration_dir
from tests import slurm_cluster
from tests.slurm_cluster import ClusterUnavailable, SlurmCluster, free_ports, unavailable
from tests.test_pipeline_executor import MODEL, ROOT, metrics, start

SCRIPT = os.path.join(ROOT, "examples", "slurm_pretrain_llama.sbatch")
# The signal leaves 6 iterations for Slurm to deliver it before the end (on a fast
# machine an iteration of the test model takes a fraction of a second; in bf16 on a CPU
# without bf16 instructions, about a CPU second for the two ranks: each one the job and
# the reference run do not need is two)
TRAIN_ITERS = 7
SIGNAL_AFTER = 1  # iterations logged before the signal: the handlers are installed by then
# one batch per evaluation (at iteration 5 and at the end, validation and test): the
# resumed run's match the uninterrupted run's as well as two would
EXTRA = ["--train-iters", str(TRAIN_ITERS), "--eval-iters", "1"]
ADDED_BY_SCRIPT = ["--pipeline-schedule", "decoupled", "--bf16"]  # besides save/load/signals
VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture
def slurm():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        try:
            cluster.start()
        except ClusterUnavailable as exc:
            pytest.skip(str(exc))
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.processes(), "a process of the test cluster outlived it"
    assert not os.path.exists(cluster.directory)


def _segments(job_id: str) -> list[str]:
    """The job's shared-memory segments (named after torchrun's run id, the job id)."""
    prefix = job_prefix(resolve_job_id(env={"TORCHELASTIC_RUN_ID": job_id}))
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def _read_metrics(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _wait(cluster, job_id, log, done, what, timeout=120.0, local=None):
    """Poll until `done(job fields)`, or until `local()` (a file of the job's, looked at
    every 0.1 s; the job's state is then asked once a second only to see it fail); a job
    that ends otherwise fails with its log. Each question to Slurm is an scontrol process
    and an RPC: asked every 0.5 s, not more often."""
    deadline = time.monotonic() + timeout
    asked = -1.0
    while True:
        if local is not None and local():
            return None
        if local is None or time.monotonic() - asked >= 1.0:
            asked = time.monotonic()
            fields = cluster.job(job_id)
            if local is None and done(fields):
                return fields
            if fields.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                          "COMPLETED"):
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1 if local is not None else 0.5)
    text = log.read_text() if log.exists() else "(no log)"
    pytest.fail(f"job {job_id} never reached {what}: {fields}\n{text[-4000:]}\n"
                f"{cluster.logs()}")


def test_without_root_or_slurm_the_reason_to_skip_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "SBIN_PATH", "/nonexistent")
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = unavailable()
    assert reason is not None and "slurmctld" in reason and "sbatch" in reason
    assert "apt-get install slurm-wlm munge" in reason
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert unavailable().startswith("not root")


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_signal_before_the_time_limit_saves_requeues_and_continues_the_run(
        slurm, tmp_path, demo_cache):
    out = tmp_path / "job"
    out.mkdir()
    ckpt, log, metrics_file = out / "ckpt", out / "job.log", out / "metrics.jsonl"
    (master_port,) = free_ports(1)
    env = {"PATH": f"{VENV_BIN}:{slurm.env['PATH']}", "OMP_NUM_THREADS": "1",
           "GPUS_PER_NODE": "2", "MASTER_PORT": str(master_port), "CKPT": str(ckpt)}
    job_id = slurm.run(
        "sbatch", "--parsable", "--gpus-per-node=0", f"--output={log}", f"--chdir={ROOT}",
        SCRIPT, *MODEL, "--data-cache-dir", demo_cache, *EXTRA,
        "--metrics-file", str(metrics_file), env=env).stdout.strip()

    # SIGUSR1 to the batch shell alone, as Slurm sends it before the time limit
    _wait(slurm, job_id, log, None, f"iteration {SIGNAL_AFTER}",
          local=lambda: len(_read_metrics(metrics_file)) >= SIGNAL_AFTER)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    _wait(slurm, job_id, log, lambda f: f.get("Restarts") == "1", "requeued")
    # the uninterrupted run, on the cores the requeued job leaves idle until it restarts
    reference = start(tmp_path, "reference", 2, *EXTRA, *ADDED_BY_SCRIPT)
    first = log.read_text()
    stopped = int((ckpt / TRACKER).read_text())
    assert f"no checkpoint in {ckpt}: starting from scratch" in first  # --load of the empty dir
    assert SIGNAL_AFTER <= stopped < TRAIN_ITERS, first
    assert (f"exiting program after receiving SIGUSR1. (after iteration {stopped}: SIGUSR1 "
            "received") in first
    for rank in (0, 1):  # every rank wrote its part of the iteration it stopped after
        assert f"checkpoint iteration {stopped}: rank {rank} wrote its shard" in first
        assert os.path.getsize(os.path.join(iteration_dir(str(ckpt), stopped),
                                            f"__{rank}_0.distcp")) > 0
    assert f"job {job_id} stopped cleanly before its time limit: requeued" in first
    assert [m["iteration"] for m in _read_metrics(metrics_file)
            if "evaluation" not in m] == list(range(1, stopped + 1))

    fields = _wait(slurm, job_id, log, lambda f: f.get("JobState") == "COMPLETED",
                   "completion")
    assert fields["Restarts"] == "1" and fields["ExitCode"] == "0:0", fields
    text = log.read_text()
    assert text.startswith(first), "the requeued run's log replaced the first one's"
    assert f"job {job_id} run 2 on localhost" in text
    assert f"loaded checkpoint from {ckpt} at iteration {stopped}" in text
    assert int((ckpt / TRACKER).read_text()) == TRAIN_ITERS

    reference = reference.wait()
    assert reference.returncode == 0, reference.stderr[-4000:]
    records = _read_metrics(metrics_file)
    resumed = [m for m in records if "evaluation" not in m]
    want = metrics(reference)
    assert [m["iteration"] for m in resumed] == list(range(1, TRAIN_ITERS + 1))
    for got, expected in zip(resumed, want):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), got["iteration"]
        assert got["lr"] == expected["lr"]
        assert got["consumed_samples"] == expected["consumed_samples"]
    evaluations = [(m["iteration"], m["evaluation"]) for m in records if "evaluation" in m]
    assert evaluations == [(m["iteration"], m["evaluation"])
                           for m in metrics(reference, evaluations=True)]
    for got, expected in zip([m for m in records if "evaluation" in m],
                             metrics(reference, evaluations=True)):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got
    assert "Traceback" not in text, text[-4000:]
    assert not _segments(job_id), "the job left shared-memory segments behind"
