"""What a rank says when another did not answer in time: one line naming the rank it waited
for, what it waited at, the timeout and the checkpoint the job can resume from, instead of
gloo's traceback ("Timed out waiting 60000ms for recv operation to complete"), which says
neither who nor what."""

from __future__ import annotations

from megatron.config.run import RunConfig
from megatron.pipeline.executor import InstructionError
from megatron.training.checkpointing import CheckpointError, latest_iteration
from megatron.training.distributed import PeerTimeout, causes, collective_timeout


def waited_too_long(run: RunConfig, rank: int, iteration: int,
                    exc: BaseException) -> PeerTimeout:
    """`rank`'s line when a wait (`exc`: gloo's timeout, raised in `iteration`, 0: the
    set-up) ran past the collective timeout: the rank it waited for (the instruction's peer;
    in a collective, any other), the instruction or collective, the timeout, and the last
    checkpoint."""
    timeout = collective_timeout(run.parallel.distributed_timeout_minutes)
    failed = next((e for e in causes(exc) if isinstance(e, InstructionError)), None)
    if failed is not None:
        instr = failed.instruction
        peer = f"rank {instr.peer}" if instr.peer >= 0 else "another rank"
        where = f"{instr} (instruction {failed.index} of {failed.when})"
    else:
        peer = "another rank"
        where = ("a collective of the set-up" if iteration == 0
                 else f"a collective of iteration {iteration}")
    return PeerTimeout(f"rank {rank}: {peer} did not answer within {timeout} while rank "
                       f"{rank} waited at {where}: it stopped, hung or cannot be reached; "
                       f"{last_checkpoint(run)}")


def last_checkpoint(run: RunConfig) -> str:
    """Where a run that stops now resumes from, in words."""
    c = run.checkpointing
    started = f" (it started from --load {c.load}, unchanged)" if c.load else ""
    if not c.save:
        return f"no --save: nothing of this run is saved{started}"
    try:
        saved = latest_iteration(c.save)
    except (OSError, CheckpointError):
        saved = None
    if saved is None:
        return f"no checkpoint in {c.save} yet{started}"
    return (f"the last checkpoint, iteration {saved} in {c.save}, is intact (resume with "
            f"--load {c.save})")
