"""Data parallelism with ZeRO over the host optimizer, on real processes (torchrun, gloo).

D = 2 replicas of a 2-rank decoupled pipeline (4 processes, d = 2) and of a 1-rank
pipeline (2 processes) train on the same global batch as one process: losses, skipped
iterations (an injected overflow rolls back every replica's shards) and the final fp32
masters and Adam moments of the checkpoint agree within 1e-5, for ZeRO-0, 1 and 2. The
optimizer state each process holds halves with ZeRO-2, and a node holds one shared copy
of the working parameters whatever the number of replicas.
"""

import json
import os
import uuid

import pytest
import torch

from megatron.common.units import format_bytes
from megatron.offload.naming import resolve_job_id
from megatron.offload.param_store import job_segments
from megatron.pipeline.data_parallel import ParallelLayout, shard_range
from megatron.training.checkpointing import read_all_tensors
from megatron.training.training import main
from tests import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 3
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "160",
         "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0", "--log-interval", "1",
         "--inject-overflow", "1,1,1"]  # iteration 1 overflows in backward stage (1, 1)
SPLIT = ["--forward-stages", "2", "--backward-split", "2"]


class _Run:
    """`script` on `nproc` ranks (forks of the session's preloaded zygote), started; its
    outputs go to `out`."""

    def __init__(self, script, nproc, cache, out, *after):
        self.out = out
        self.job = forked_ranks.start(script, [*MODEL, "--data-cache-dir", cache, *after],
                                      nproc, env={"OMP_NUM_THREADS": "1"})

    def wait(self):
        proc = self.job.wait(timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        (self.out / "stdout.log").write_text(proc.stdout)
        return self.out


@pytest.fixture(scope="module")
def cache(demo_cache):
    return demo_cache


@pytest.fixture(scope="module")
def started(request, tmp_path_factory, cache):
    """The one-process reference and the replicated runs the selected tests need, started
    together (one run's bubbles are another's compute)."""
    needed = {name for item in request.session.items if item.module is request.module
              for name in item.fixturenames}
    runs = {}
    if "reference" in needed:
        out = tmp_path_factory.mktemp("dp-ref")
        runs["reference"] = _Run("pretrain_llama.py", 1, cache, out, "--metrics-file",
                                 str(out / "metrics.jsonl"), "--save", str(out / "ckpt"))
    for name, nproc, zero_stages in (("two_by_two", 4, "1,2"), ("two_by_one", 2, "0,2")):
        if name in needed:
            out = tmp_path_factory.mktemp(f"dp{nproc}")
            runs[name] = _Run("tests/run_schedules.py", nproc, cache, out, "--out-dir",
                              str(out), "--schedules", "decoupled", "--zero-stages",
                              zero_stages, "--data-parallel-size", "2", "--p2p-check", *SPLIT)
    return runs


@pytest.fixture(scope="module")
def reference(started):
    return started["reference"].wait()


@pytest.fixture(scope="module")
def two_by_two(started):
    return started["two_by_two"].wait()


@pytest.fixture(scope="module")
def two_by_one(started):
    return started["two_by_one"].wait()


def _metrics(directory):
    with open(directory / "metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "evaluation" not in row]


def _assert_same_training(directory, reference, rel=1e-5):
    ours, ref = _metrics(directory), _metrics(reference)
    assert [m["skipped"] for m in ours] == [True, False, False]
    for a, b in zip(ours, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel), a["iteration"]
        assert a["skipped"] == b["skipped"]
    step = f"iter_{ITERS:07d}"
    got = read_all_tensors(str(directory / "ckpt" / step))
    want = read_all_tensors(str(reference / "ckpt" / step))
    names = [k for k in want if k.startswith(("model.", "optimizer."))]
    assert names and set(names) <= set(got)
    for name in names:  # masters and both Adam moments, each saved once
        error = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)
        assert error < rel, (name, float(error))


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [1, 2])
def test_two_replicas_of_a_two_rank_pipeline_train_like_one_process(zero, two_by_two,
                                                                   reference):
    _assert_same_training(two_by_two / f"decoupled-zero{zero}", reference)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [0, 2])
def test_two_replicas_of_a_one_rank_pipeline_train_like_one_process(zero, two_by_one,
                                                                   reference):
    _assert_same_training(two_by_one / f"decoupled-zero{zero}", reference)


@pytest.mark.multiproc
def test_zero2_halves_the_optimizer_state_and_a_node_keeps_one_parameter_copy(
        two_by_one, reference):
    params = sum(t.numel() for k, t in read_all_tensors(
        str(reference / "ckpt" / f"iter_{ITERS:07d}")).items() if k.startswith("model."))
    full = _metrics(two_by_one / "decoupled-zero0")[-1]
    zero2 = _metrics(two_by_one / "decoupled-zero2")[-1]
    # fp32 master, m and v: every parameter in each of the two processes without ZeRO
    # (as with one replica), half of them each with ZeRO-2 (up to the 1-element
    # placeholders of empty optimizer groups: 4 groups x 12 bytes at most).
    assert full["host_optimizer_state_bytes"] == 12 * params
    assert abs(zero2["host_optimizer_state_bytes"] - 6 * params) <= 4 * 12
    # One fp32 working copy in the node's shared memory, not one per replica.
    for row in (full, zero2):
        assert row["shared_memory_bytes_per_node"] == 4 * params
    # The log says so at start-up, once per run (ZeRO-0, then ZeRO-2), in the same figures.
    lines = [line for line in (two_by_one / "stdout.log").read_text().splitlines()
             if "host memory per process" in line]
    assert len(lines) == 2
    for line, row in zip(lines, (full, zero2)):
        assert f"optimizer state (master, exp_avg, exp_avg_sq) " \
               f"{format_bytes(row['host_optimizer_state_bytes'])}," in line
        assert f"shared memory per node {format_bytes(4 * params)}" in line


@pytest.mark.multiproc
def test_zero2_shards_resume_on_one_process_and_one_process_resumes_on_shards(
        tmp_path, cache, two_by_one, reference):
    """The checkpoint 2 replicas saved from their ZeRO-2 shards resumes on one process, and
    one process's checkpoint resumes on 2 replicas that keep only their shards: both go on
    from the same state (the two checkpoints agree, see above), so the next iteration's
    loss and the final masters agree too."""
    runs = {}
    for name, nproc, load in (("one", 1, two_by_one / "decoupled-zero2" / "ckpt"),
                              ("two", 2, reference / "ckpt")):
        out = tmp_path / name
        out.mkdir()
        flags = ["--data-parallel-size", "2", "--zero-stage", "2", *SPLIT] if name == "two" else []
        runs[name] = _Run("pretrain_llama.py", nproc, cache, out, *flags, "--load", str(load),
                          "--train-iters", str(ITERS + 1), "--metrics-file",
                          str(out / "metrics.jsonl"), "--save", str(out / "ckpt"))
    runs = {name: run.wait() for name, run in runs.items()}  # both ran at once
    one, two = (_metrics(runs[name]) for name in ("one", "two"))
    assert [m["iteration"] for m in one] == [m["iteration"] for m in two] == [ITERS + 1]
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    step = f"iter_{ITERS + 1:07d}"
    got = read_all_tensors(str(runs["two"] / "ckpt" / step), prefix="model.")
    want = read_all_tensors(str(runs["one"] / "ckpt" / step), prefix="model.")
    assert want and set(got) == set(want)
    for name, tensor in want.items():
        error = (got[name] - tensor).norm() / tensor.norm().clamp_min(1e-30)
        assert error < 1e-5, (name, float(error))


def test_rank_layout_is_megatron_cores():
    # data-parallel ranks vary fastest (tensor parallel 1): what parallel_state builds,
    # which every run also checks at start-up against megatron-core's own groups.
    layout = ParallelLayout(pipeline_size=2, data_parallel_size=2, rank=3)
    assert (layout.pipeline_rank, layout.data_parallel_rank) == (1, 1)
    assert layout.pipeline_ranks() == [1, 3]
    assert layout.data_parallel_ranks() == [2, 3]
    assert layout.all_pipeline_groups() == [[0, 2], [1, 3]]
    assert layout.all_data_parallel_groups() == [[0, 1], [2, 3]]


@pytest.mark.parametrize("numel,parts", [(10, 2), (11, 2), (7, 3), (2, 4)])
def test_shards_cover_a_stage_once(numel, parts):
    covered = torch.zeros(numel, dtype=torch.int64)
    for index in range(parts):
        lo, hi = shard_range(numel, parts, index)
        covered[lo:hi] += 1
    assert bool((covered == 1).all())


@pytest.mark.parametrize("extra,env,flag", [
    (["--data-parallel-size", "2"], {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": "29500"}, "--data-parallel-size"),
    (["--data-parallel-size", "3"], {}, "--global-batch-size"),
    (["--zero-stage", "3"], {}, "--zero-stage"),
    (["--data-parallel-size", "2", "--procs-per-node", "3"], {}, "--procs-per-node"),
])
def test_bad_data_parallel_flags_exit_2_naming_the_flag(extra, env, flag, monkeypatch, capsys,
                                                       tmp_path):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # this run's segments would carry this job id (others may run beside this test)
    job = f"refused-{uuid.uuid4().hex}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    with pytest.raises(SystemExit) as exit_info:
        main([*MODEL, "--data-cache-dir", str(tmp_path), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
    assert job_segments(resolve_job_id()) == []  # nothing allocated
    assert not os.listdir(tmp_path)  # not even the data cache
