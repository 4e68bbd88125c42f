"""bench/pipeline_sweep.py: ours beside the paper's Fig. 10, 11, 12 and 14 (two 1-node models)."""

import json

from bench.pipeline_sweep import PAPER_FIG10, PAPER_FIG11, main


def test_the_sweep_prints_ours_beside_the_paper_with_relative_errors(capsys):
    assert main(["--models", "10b,19b"]) == 0
    out = json.loads(capsys.readouterr().out)
    fig10 = out["fig10_mbs_scaling"]["average_by_mbs"]
    fig11 = out["fig11_gbs_scaling"]["average_by_gbs_factor"]
    assert set(fig10) == {"1", "2", "4", "8"} and set(fig11) == {"1", "2", "3", "4"}
    for points, paper in ((fig10, PAPER_FIG10), (fig11, PAPER_FIG11)):
        for point, metrics in points.items():
            for metric, value in metrics.items():
                assert value["paper"] == paper[metric][int(point)]
                assert abs(value["rel_error"]
                           - (value["ours"] - value["paper"]) / value["paper"]) < 2e-3
    totals = [abs(p["speedup_total"]["rel_error"]) for p in (*fig10.values(), *fig11.values())]
    assert out["max_rel_error_vs_paper"] == max(totals)
    # 19B has no MBS-8 point (Mobius ran out of memory there in the paper)
    mbs8 = [row for row in out["fig10_mbs_scaling"]["runs"] if row["mbs"] == 8]
    assert {row["model"]: row["mobius_oom"] for row in mbs8} == {"10b": False, "19b": True}
    assert set(out["fig12_gpu_time_share"]) == {"19b"}
    share = out["fig12_gpu_time_share"]["19b"]
    assert 0 < share["ours"] < 1 and share["paper"] == 0.413
    rollback = out["fig14_rollback_overhead_10b"]
    assert rollback["8"]["paper"] == 0.53 and rollback["32"]["paper"] == 0.08
    # the overhead falls as the batch (and the iteration) grows
    assert rollback["8"]["ours"] > rollback["16"]["ours"] > rollback["32"]["ours"] > 0
