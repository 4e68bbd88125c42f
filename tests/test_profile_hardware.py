"""tools/profile_hardware.py as a user runs it: the NVMe fields of the profile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.nvme_optimizer import filesystem_of
from megatron.optimizer.state_io import direct_io_supported

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / "tools" / "profile_hardware.py")
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def run(*args: str) -> subprocess.CompletedProcess:
    # the tiny preset and a small file keep the whole profile to a few seconds
    return subprocess.run([sys.executable, TOOL, "--model-preset", "tiny", "--rounds", "1", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_nvme_path_measures_the_drive_and_removes_its_file(tmp_path):
    drive = tmp_path / "drive"
    drive.mkdir()
    if filesystem_of(str(drive)) in ("tmpfs", "ramfs") or not direct_io_supported(str(drive)):
        pytest.skip(f"{drive} is not on a drive that takes O_DIRECT")
    out = tmp_path / "hw.json"
    done = run("--nvme-path", str(drive), "--nvme-bytes", "16MiB", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads(out.read_text())
    assert profile["nvme_read_bytes_per_s"] > 0
    assert profile["nvme_write_bytes_per_s"] > 0
    assert profile["nvme_capacity_bytes"] > 0
    assert "NVMe" in profile["source"]
    assert [line for line in done.stderr.splitlines() if "profile_hardware: NVMe" in line]
    assert os.listdir(drive) == []  # the temporary file is gone


def test_nvme_path_on_tmpfs_is_refused_in_one_line():
    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    done = run("--nvme-path", "/dev/shm")  # refused before anything is measured
    assert done.returncode == 2
    assert "tmpfs" in done.stderr.strip().splitlines()[-1]
