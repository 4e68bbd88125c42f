"""Steps every rank's program with blocking-communication semantics.

Shared by the validator (which checks rules) and the simulator (which keeps clocks).
Semantics modelled (each op's `Stepping` in instructions.OP_SPECS):
- a blocking send and its receive form a rendezvous: neither completes until both ranks
  have reached them (gloo's send/recv);
- ISEND_CKPT and IRECV_CKPT never block; WAIT_CKPT blocks until the peer's matching
  ISEND_CKPT has been posted;
- OVERFLOW_SYNC and POST_STEP_SYNC are all-reduces: every rank must reach the same one.
A rank that can never continue is a deadlock, reported as a ScheduleError.
"""

from __future__ import annotations

from .instructions import (
    BLOCKING_SENDS,
    COLLECTIVES,
    OP_SPECS,
    Instruction,
    Op,
    Schedule,
    Stepping,
)


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the instruction and the rule."""

    def __init__(self, rank: int, index: int, instruction: Instruction | None, rule: str,
                 detail: str) -> None:
        where = f"instruction #{index} ({instruction})" if instruction else "end of program"
        super().__init__(f"rank {rank}, {where}: rule '{rule}' violated: {detail}")
        self.rank, self.index, self.instruction, self.rule = rank, index, instruction, rule


_MATCHING_RECV = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD}
RULE_MATCHED = "every send matched by a receive"
RULE_DEADLOCK = "no deadlock under blocking send/recv"


class Interpreter:
    """Subclasses implement the hooks; `run` drives them in a causally valid order."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.position = [0] * schedule.ranks
        self.posted_isends: dict[tuple, int] = {}  # tensor key -> sending rank

    # Hooks -------------------------------------------------------------------------
    def local(self, rank: int, index: int, ins: Instruction) -> None:
        """A non-blocking instruction, or a WAIT_CKPT whose ISEND has been posted."""

    def rendezvous(self, sender: int, send_index: int, receiver: int, recv_index: int) -> None:
        """A blocking send and its receive complete together."""

    def collective(self, op: Op, indices: list[int]) -> None:
        """Every rank reached the same collective (indices[rank] is its position)."""

    def finish(self) -> None:
        """Called once when every program ran to its end."""

    # Driver ------------------------------------------------------------------------
    def current(self, rank: int) -> Instruction | None:
        program = self.schedule.programs[rank]
        position = self.position[rank]
        return program[position] if position < len(program) else None

    def _advance_locally(self, rank: int, woken: set[int]) -> bool:
        """Run `rank` until it blocks; True if it moved. A rank waiting for a checkpoint
        this rank posts is added to `woken`."""
        moved = False
        while (ins := self.current(rank)) is not None:
            stepping = OP_SPECS[ins.op].stepping
            if stepping in (Stepping.SEND, Stepping.RECV, Stepping.COLLECTIVE):
                break
            if stepping == Stepping.WAIT_POSTED and ins.tensor_key not in self.posted_isends:
                self._waiting_for[ins.tensor_key] = rank
                break
            if ins.op == Op.ISEND_CKPT:
                self.posted_isends[ins.tensor_key] = rank
                if ins.tensor_key in self._waiting_for:
                    woken.add(self._waiting_for.pop(ins.tensor_key))
            self.local(rank, self.position[rank], ins)
            self.position[rank] += 1
            moved = True
        return moved

    def _try_rendezvous(self, rank: int) -> bool:
        ins = self.current(rank)
        if ins is None or ins.op not in BLOCKING_SENDS:
            return False
        peer = ins.peer
        if not 0 <= peer < self.schedule.ranks or peer == rank:
            raise ScheduleError(rank, self.position[rank], ins, RULE_MATCHED,
                                f"peer {peer} is not another rank")
        other = self.current(peer)
        if (other is None or other.op != _MATCHING_RECV[ins.op] or other.peer != rank
                or other.tensor_key != ins.tensor_key):
            return False
        self.rendezvous(rank, self.position[rank], peer, self.position[peer])
        self.position[rank] += 1
        self.position[peer] += 1
        return True

    def _try_collective(self) -> bool:
        heads = [self.current(rank) for rank in range(self.schedule.ranks)]
        if heads[0] is None or heads[0].op not in COLLECTIVES:
            return False
        if any(head is None or head.op != heads[0].op for head in heads):
            return False
        self.collective(heads[0].op, list(self.position))
        for rank in range(self.schedule.ranks):
            self.position[rank] += 1
        return True

    def _step(self, rank: int, woken: set[int]) -> None:
        """Move `rank` as far as it can now; the ranks its moves may unblock go to `woken`."""
        if self._advance_locally(rank, woken):
            woken.add(rank)
        ins = self.current(rank)
        if ins is None:
            return
        stepping = OP_SPECS[ins.op].stepping
        if stepping == Stepping.SEND:
            if self._try_rendezvous(rank):
                woken.update((rank, ins.peer))
        elif stepping == Stepping.RECV:
            sender = ins.peer  # the rendezvous is tried from the sender's side
            if 0 <= sender < self.schedule.ranks and sender != rank:
                head = self.current(sender)
                if head is not None and head.peer == rank and self._try_rendezvous(sender):
                    woken.update((rank, sender))
        elif stepping == Stepping.COLLECTIVE:
            self._at_collective.add(rank)
            if len(self._at_collective) == self.schedule.ranks and self._try_collective():
                self._at_collective.clear()
                woken.update(range(self.schedule.ranks))

    def run(self) -> None:
        """Rounds over the ranks that may move (all of them at first, then those woken by
        the previous round): the work is linear in the instructions, whatever the number of
        ranks. Which rank runs first does not change the outcome: every condition that
        lets a rank go on (a posted checkpoint, a peer at the matching receive, every rank
        at the collective) stays true until that rank goes on."""
        self._waiting_for: dict[tuple, int] = {}  # checkpoint key -> rank waiting for it
        self._at_collective: set[int] = set()
        ready: set[int] = set(range(self.schedule.ranks))
        while ready:
            woken: set[int] = set()
            for rank in sorted(ready):
                self._step(rank, woken)
            ready = woken
        blocked = [rank for rank in range(self.schedule.ranks) if self.current(rank) is not None]
        if blocked:
            self._report_stuck(blocked)
        self.finish()

    def _report_stuck(self, blocked: list[int]) -> None:
        rank = blocked[0]
        ins = self.current(rank)
        index = self.position[rank]
        if ins.op in COLLECTIVES:
            waiting = {r: str(self.current(r)) for r in range(self.schedule.ranks)
                       if self.current(r) != ins}
            raise ScheduleError(rank, index, ins, RULE_DEADLOCK,
                                f"collective never reached by every rank; others at {waiting}")
        peer = ins.peer
        if not 0 <= peer < self.schedule.ranks or peer == rank:
            raise ScheduleError(rank, index, ins, RULE_MATCHED, f"peer {peer} is not another rank")
        if ins.op == Op.WAIT_CKPT:
            peer_has_it = any(
                other.op == Op.ISEND_CKPT and other.tensor_key == ins.tensor_key
                for other in self.schedule.programs[peer])
            if not peer_has_it:
                raise ScheduleError(rank, index, ins, RULE_MATCHED,
                                    f"rank {peer} never posts the matching ISEND_CKPT")
        else:
            partner = (_MATCHING_RECV.get(ins.op)
                       or next(s for s, r in _MATCHING_RECV.items() if r == ins.op))
            remaining = self.schedule.programs[peer][self.position[peer]:]
            if not any(other.op == partner and other.peer == rank
                       and other.tensor_key == ins.tensor_key for other in remaining):
                raise ScheduleError(rank, index, ins, RULE_MATCHED,
                                    f"rank {peer} has no matching {partner.value} left")
        raise ScheduleError(rank, index, ins, RULE_DEADLOCK,
                            f"blocked while rank {peer} waits at "
                            f"#{self.position[peer]} ({self.current(peer)})")
