"""Device memory of optimizer subgroups, shared by the runtime (which allocates it) and the
memory model (which plans it). Pure arithmetic.

Interleaved subgroups (Deep Optimizer States) use two device slots, each holding one
subgroup's fp32 p, m, v and gradient (16 bytes per parameter) and its 16-bit copy; the
static split (Twin-Flow) keeps fp32 p, m, v and a gradient buffer on the device for every
resident parameter. Both are fp32 on the device whatever the host state's precision
(a bf16 master, m or v widens on the load; the step rounds it as the host keeps it), so
their size does not depend on --optimizer-state-dtype or --master-dtype.
"""

from __future__ import annotations

# One subgroup flushing (D2H) while the next one loads (H2D). Two whatever the split: with
# consecutive device subgroups (a GPU-heavy device:N) the load of subgroup i + 2 waits for
# the flush of i out of the same slot (an event), so no third is ever in flight; and two
# keep Eq. 1's pace (a subgroup every (load + update + flush) / 2 <= max(load, flush) +
# update, what Eq. 1 prices per device subgroup).
SUBGROUP_SLOTS = 2
FP32_SLOT_BYTES_PER_PARAM = 16  # p, m, v, gradient
FLAG_BYTES = 16  # per slot: the finite flag and the squared norm, float64
RESIDENT_BYTES_PER_PARAM = 16  # p, m, v kept, plus the gradient's landing buffer
MIN_SUBGROUP = 4096  # parameters: below it a subgroup's copies are all latency


def default_subgroup_size(largest_group: int) -> int:
    """An eighth of the largest group split, at least 4096 parameters: enough subgroups
    for the stride to interleave, each large enough to keep the copies efficient."""
    return max(MIN_SUBGROUP, -(-largest_group // 8))


def subgroup_slots_bytes(max_numel: int, out_itemsize: int = 2) -> int:
    """Device bytes of the slots for subgroups of at most `max_numel` parameters."""
    return SUBGROUP_SLOTS * (max_numel * (FP32_SLOT_BYTES_PER_PARAM + out_itemsize) + FLAG_BYTES)


def subgroup_size_within(budget_bytes: int, out_itemsize: int = 4) -> int:
    """The largest subgroup whose slots fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // subgroup_slots_bytes(1, out_itemsize))


def planned_subgroup_size(requested: int | None, largest_group: int, budget_bytes: int) -> int:
    """The subgroup size the runtime uses: the requested one (or the default), no larger
    than the largest group, shrunk to fit the budget (what the gradient buffers hold)."""
    size = min(requested or default_subgroup_size(largest_group), largest_group)
    return min(size, subgroup_size_within(budget_bytes))
