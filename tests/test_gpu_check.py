"""tools/gpu_check.py (`make gpu-check`): what it says without a GPU, how it reports steps."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.unit


def test_without_a_cuda_device_it_says_so_in_one_line_and_writes_nothing(
        tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not out.exists()


def test_a_step_records_its_figures_or_why_it_failed():
    figures = gpu_check.run_step("json", ["-c", "print('{\"GBps\": 12.5}')"], True, 60)
    assert figures["passed"] and figures["figures"] == {"GBps": 12.5}
    failed = gpu_check.run_step("fails", ["-c", "import sys; sys.exit(3)"], False, 60)
    assert not failed["passed"] and failed["status"] == 3
    garbled = gpu_check.run_step("garbled", ["-c", "print('not json')"], True, 60)
    assert not garbled["passed"] and "not one JSON object" in garbled["status"]
    assert gpu_check.verdict([figures], ["H100"]).startswith("gpu-check: passed")
    assert "FAILED (fails, garbled)" in gpu_check.verdict([figures, failed, garbled], [])
