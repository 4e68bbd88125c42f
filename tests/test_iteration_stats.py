"""The pipeline's report of an iteration: what counts as exposed optimizer time.

A rank that joins the verdict's all-reduce first waits there for its peers' last
backwards: that is a bubble of the pipeline, not optimizer work the rank exposes."""

import pytest

from megatron.pipeline.iteration_stats import attribute_peer_waits
from megatron.schedules.timeline import TimedEvent, legend_text


def _row(exposed: float, verdict: float, bubble: float) -> dict:
    return {"exposed_optimizer_time_s": exposed, "exposed_optimizer_cpu_time_s": exposed,
            "verdict_wait_s": verdict, "bubble_time_s": bubble, "verdict_peer_wait_s": 0.0}


def test_waiting_at_the_verdict_for_a_peer_is_bubble_and_the_reduction_stays_exposed():
    # Rank 0 (done with its backwards) sat 58 ms in the all-reduce while rank 1 ran its last
    # backward, stepped its last stage for 3 ms and then joined: the reduction took 6 ms.
    rank0, rank1 = _row(0.0585, verdict=0.058, bubble=0.150), _row(0.0095, 0.006, 0.396)
    attribute_peer_waits([rank0, rank1])
    assert rank0["verdict_peer_wait_s"] == pytest.approx(0.052)
    assert rank0["exposed_optimizer_time_s"] == pytest.approx(0.0065)  # 0.5 ms + the reduction
    assert rank0["exposed_optimizer_cpu_time_s"] == pytest.approx(0.0065)
    assert rank0["bubble_time_s"] == pytest.approx(0.202)  # nothing lost, nothing added
    # the rank that joined last exposed its own step and the reduction: unchanged
    assert rank1 == _row(0.0095, 0.006, 0.396)


def test_one_rank_exposes_all_its_time_at_the_verdict():
    alone = _row(0.030, verdict=0.020, bubble=0.1)
    attribute_peer_waits([alone])
    assert alone == _row(0.030, 0.020, 0.1)


def test_the_timeline_legend_tells_the_verdict_from_optimizer_states():
    # "sync" begins like "sS,k" (states copied), "wait" like "wS,k", "fix" like "fS"
    events = [TimedEvent(0, "cpu-optimizer", 0.0, 0.001, label, "optimizer")
              for label in ("wait", "sync", "fix")]
    legend = legend_text(events)
    assert "sync: overflow and norm all-reduce" in legend
    assert "wait: waiting for the rank's optimizer steps" in legend
    assert "fix: deferred clipping corrections" in legend
    for other in ("sS,k", "wS,k", "fS"):
        assert other not in legend
