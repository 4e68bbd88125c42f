"""Which parameter, and which element of it, each element of a stage's optimizer groups
is: the identity the stochastic rounding of a bf16 master is keyed by
(megatron/optimizer/rounding.py), so that the same parameter rounds the same way
whatever the pipeline shape or the backward split."""

from __future__ import annotations

from megatron.optimizer.rounding import ElementRun, parameter_id
from megatron.pipeline.stage_modules import StageModule


def group_element_runs(module: StageModule, lo: int, hi: int) -> list[ElementRun]:
    """ElementRuns tiling the group that holds layout elements [lo, hi) of `module`
    (parameters by their whole-model names; elements outside every parameter, if any,
    count as parameter 0)."""
    runs, at = [], lo
    for s, name in sorted(zip(module.layout.slices, module.model_names()),
                          key=lambda pair: pair[0].offset):
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b:
            continue
        if a > at:
            runs.append(ElementRun(at - lo, a - lo, 0, at))
        runs.append(ElementRun(a - lo, b - lo, parameter_id(name), a - s.offset))
        at = b
    if at < hi or not runs:
        runs.append(ElementRun(at - lo, max(hi, at + 1) - lo, 0, at))
    return runs
