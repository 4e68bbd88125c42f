"""Steps every rank's program with blocking-communication semantics.

Shared by the validator (which checks rules) and the simulator (which keeps clocks).
Semantics modelled (each op's `Stepping` in instructions.OP_SPECS):
- blocking transfers go in batches (instructions.transfer_batches: consecutive ones with
  one peer, as the executor posts them with batch_isend_irecv): a rank posts its whole
  batch, each send completes together with its receive once both are posted (a
  rendezvous), and the rank goes on when every transfer of the batch is done;
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
    transfer_batches,
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
        self._batches = [{batch.start: batch for batch in transfer_batches(program)}
                         for program in schedule.programs]

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

    def _post_batch(self, rank: int, woken: set[int]) -> None:
        """Post the batch of blocking transfers `rank` is at (instructions.transfer_batches)
        and match each with what its peer has posted; the rank goes on when all are matched."""
        program = self.schedule.programs[rank]
        batch = self._batches[rank][self.position[rank]]
        self._open[rank] = (batch, set(batch))
        for index in batch:
            ins = program[index]
            peer = ins.peer
            if not 0 <= peer < self.schedule.ranks or peer == rank:
                raise ScheduleError(rank, index, ins, RULE_MATCHED,
                                    f"peer {peer} is not another rank")
            sending = ins.op in BLOCKING_SENDS
            key = (rank, peer, ins.tensor_key) if sending else (peer, rank, ins.tensor_key)
            waiting, mine = ((self._posted_recvs, self._posted_sends) if sending
                             else (self._posted_sends, self._posted_recvs))
            if waiting.get(key):
                other = waiting[key].pop(0)
                if sending:
                    self.rendezvous(rank, index, peer, other)
                else:
                    self.rendezvous(peer, other, rank, index)
                self._matched(peer, other, woken)
                self._matched(rank, index, woken)
            else:
                mine.setdefault(key, []).append(index)

    def _matched(self, rank: int, index: int, woken: set[int]) -> None:
        """One transfer of `rank`'s open batch is done; the last one closes the batch."""
        batch, unmatched = self._open[rank]
        unmatched.discard(index)
        if not unmatched:
            del self._open[rank]
            self.position[rank] = batch.stop
            woken.add(rank)

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
        if stepping in (Stepping.SEND, Stepping.RECV):
            if rank not in self._open:
                self._post_batch(rank, woken)
        elif stepping == Stepping.COLLECTIVE:
            self._at_collective.add(rank)
            if len(self._at_collective) == self.schedule.ranks and self._try_collective():
                self._at_collective.clear()
                woken.update(range(self.schedule.ranks))

    def run(self) -> None:
        """Rounds over the ranks that may move (all of them at first, then those woken by
        the previous round): the work is linear in the instructions, whatever the number of
        ranks. Which rank runs first does not change the outcome: every condition that
        lets a rank go on (a posted checkpoint, a transfer its peer has posted, every rank
        at the collective) stays true until that rank goes on."""
        self._waiting_for: dict[tuple, int] = {}  # checkpoint key -> rank waiting for it
        # Blocking transfers posted and not matched yet: (sender, receiver, tensor key) ->
        # their indices in the sender's / the receiver's program.
        self._posted_sends: dict[tuple, list[int]] = {}
        self._posted_recvs: dict[tuple, list[int]] = {}
        # rank -> (its batch of blocking transfers being posted, the indices not matched)
        self._open: dict[int, tuple[range, set[int]]] = {}
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

    def _waiting_at(self, rank: int) -> tuple[int, Instruction | None]:
        """Where `rank` waits: the first unmatched transfer of its open batch, else its
        current instruction."""
        if rank in self._open:
            index = min(self._open[rank][1])
            return index, self.schedule.programs[rank][index]
        return self.position[rank], self.current(rank)

    def _report_stuck(self, blocked: list[int]) -> None:
        rank = blocked[0]
        index, ins = self._waiting_at(rank)
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
        peer_index, peer_ins = self._waiting_at(peer)
        raise ScheduleError(rank, index, ins, RULE_DEADLOCK,
                            f"blocked while rank {peer} waits at #{peer_index} ({peer_ins})")
