"""Per-job, per-node names for shared-memory segments.

Two jobs on one node must never collide, and the next start of the same job must find
(and remove) what a killed run left behind, so names derive from the job identity the
launcher provides, plus the node index (several simulated nodes can share one host).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

SEGMENT_PREFIX = "mlm-"


def resolve_job_id(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The job identity: `explicit`, else TORCHELASTIC_RUN_ID, else MASTER_ADDR:MASTER_PORT."""
    env = os.environ if env is None else env
    if explicit:
        return explicit
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"run:{run_id}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"addr:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    raise ValueError(
        "job_id=None and neither TORCHELASTIC_RUN_ID nor MASTER_ADDR/MASTER_PORT is set: "
        "pass a job id or start under torchrun"
    )


def resolve_procs_per_node(
    explicit: int | None = None, env: Mapping[str, str] | None = None
) -> int:
    """Processes per node: `explicit` (simulated nodes in tests), else LOCAL_WORLD_SIZE."""
    env = os.environ if env is None else env
    value = explicit if explicit is not None else int(env.get("LOCAL_WORLD_SIZE", "1"))
    if value < 1:
        raise ValueError(f"procs_per_node={value}: expected at least 1")
    return value


def job_prefix(job_id: str) -> str:
    """File-name prefix shared by all segments of a job on every node."""
    digest = hashlib.sha1(job_id.encode()).hexdigest()[:12]
    return f"{SEGMENT_PREFIX}{digest}-"


def namespace(job_id: str, node: int) -> str:
    """File-name prefix of one (possibly simulated) node's segments of a job."""
    return f"{job_prefix(job_id)}n{node}-"


def segment_name(job_id: str, node: int, stage: int, sub: int) -> str:
    """Name of the segment holding backward stage (stage, sub) on a node."""
    if stage < 0 or sub < 0:
        raise ValueError(f"stage key ({stage}, {sub}): expected non-negative integers")
    return f"{namespace(job_id, node)}s{stage}-{sub}"
