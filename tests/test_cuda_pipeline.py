"""On a GPU: one process running the decoupled pipeline (several stages, d = 2) trains like
the same run on the CPU device layer. Skipped without CUDA (see docs/gpu-validation.md)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "160",
       "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
       "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0", "--log-interval", "1",
       "--pipeline-schedule", "decoupled", "--forward-stages", "4", "--backward-split", "2",
       "--stage-layers", "2,2,2,2"]


def _train(tmp_path, name, env):
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_llama.py"), *RUN,
         "--data-cache-dir", str(tmp_path / "cache"), "--metrics-file", str(metrics)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_single_gpu_decoupled_run_matches_the_cpu_run(tmp_path):
    gpu = _train(tmp_path, "gpu", {})
    cpu = _train(tmp_path, "cpu", {"CUDA_VISIBLE_DEVICES": ""})
    for a, b in zip(gpu, cpu):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["iteration"], a["loss"], b["loss"])
        assert a["host_syncs"] == b["host_syncs"]
    assert gpu[-1]["device_memory_peak_bytes"] == cpu[-1]["device_memory_peak_bytes"]
