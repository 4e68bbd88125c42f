"""Discrete-event simulation of one iteration of a schedule under a cost model.

Per rank, the program runs in order on a host thread whose clock advances with compute
(FORWARD/BACKWARD occupy the compute stream synchronously) and with blocking
communication (a rendezvous: both sides leave at max(arrivals) + transfer). Parallel
resources per rank: an H2D stream (PREFETCH_PARAMS, compute waits for its parameters), a
D2H stream (OFFLOAD_GRAD), and a CPU optimizer lane (OPTIMIZER_START runs once its
gradients are home, FIFO; the node's CPU throughput is split among its GPUs). Checkpoint
transfers start when both ISEND and IRECV are posted; links are not contended.

Bubble ratio of a rank (SysX Eq. 1-3): idle compute time over the iteration time,
1 - busy / iteration_time. Exposed optimizer time: the part of the CPU optimizer's work
that lies after the last forward/backward of the iteration (nothing left to hide it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_model import CostModel
from .instructions import Instruction, Op, Schedule
from .interpreter import Interpreter
from .timeline import TimedEvent
from .validator import validate


@dataclass(frozen=True)
class SimResult:
    schedule: str
    iteration_time: float
    busy: tuple[float, ...]  # compute time per rank
    bubble_ratio: tuple[float, ...]  # per rank
    mean_bubble_ratio: float
    compute_end: float  # when the last forward/backward ends
    exposed_optimizer_time: float
    peak_params: tuple[int, ...]  # resident backward stages' parameters, per rank
    peak_checkpoints: tuple[int, ...]
    events: tuple[TimedEvent, ...]

    def summary(self) -> dict:
        """The JSON object tools/simulate_pipeline.py prints."""
        return {
            "schedule": self.schedule,
            "iteration_time": self.iteration_time,
            "bubble_ratio": self.mean_bubble_ratio,
            "per_rank": [
                {"rank": rank, "busy": busy, "bubble_ratio": ratio,
                 "peak_params": params, "peak_checkpoints": ckpts}
                for rank, (busy, ratio, params, ckpts) in enumerate(
                    zip(self.busy, self.bubble_ratio, self.peak_params, self.peak_checkpoints))
            ],
            "exposed_optimizer_time": self.exposed_optimizer_time,
            "compute_end": self.compute_end,
        }


def _piece_label(stage: int, sub: int, split: int) -> str:
    return f"{stage}" if split == 1 or sub < 0 else f"{stage},{sub}"


class _Simulator(Interpreter):
    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        super().__init__(schedule)
        ranks = range(schedule.ranks)
        self.costs = costs
        self.clock = [0.0 for _ in ranks]
        self.h2d_free = [0.0 for _ in ranks]
        self.d2h_free = [0.0 for _ in ranks]
        self.cpu_free = [0.0 for _ in ranks]
        self.param_ready = [{} for _ in ranks]
        self.grad_ready: dict = {}
        self.isend_time: dict = {}
        self.irecv_time: dict = {}
        self.busy = [0.0 for _ in ranks]
        self.events: list[TimedEvent] = []

    def _event(self, rank: int, resource: str, start: float, end: float, label: str, kind: str,
               ins: Instruction) -> None:
        if end > start:
            self.events.append(TimedEvent(rank, resource, start, end, label, kind,
                                          ins.stage, ins.sub, ins.mb))

    def _compute(self, rank: int, ins: Instruction) -> None:
        s, c = self.schedule, self.costs
        if ins.op == Op.FORWARD:
            pieces = s.stage_pieces(ins.stage, -1)
            duration = c.forward[ins.stage]
            label, kind = f"f{ins.stage}", "forward"
        else:
            pieces = [(ins.stage, ins.sub)]
            duration = c.recompute[pieces[0]] + c.backward[pieces[0]]
            label = f"b{_piece_label(ins.stage, ins.sub, s.backward_split)}"
            kind = "backward"
        start = max([self.clock[rank]] + [self.param_ready[rank][p] for p in pieces])
        self.clock[rank] = start + duration
        self.busy[rank] += duration
        self._event(rank, "compute", start, start + duration, label, kind, ins)

    def local(self, rank: int, index: int, ins: Instruction) -> None:
        s, c = self.schedule, self.costs
        op = ins.op
        now = self.clock[rank]
        if op in (Op.FORWARD, Op.BACKWARD):
            self._compute(rank, ins)
        elif op == Op.PREFETCH_PARAMS:
            pieces = s.stage_pieces(ins.stage, ins.sub)
            start = max(now, self.h2d_free[rank])
            end = start + sum(c.param_transfer[p] for p in pieces)
            self.h2d_free[rank] = end
            for piece in pieces:
                self.param_ready[rank][piece] = end
            label = f"p{_piece_label(ins.stage, ins.sub, s.backward_split)}"
            self._event(rank, "h2d", start, end, label, "prefetch", ins)
        elif op == Op.ISEND_CKPT:
            self.isend_time[ins.tensor_key] = now
        elif op == Op.IRECV_CKPT:
            self.irecv_time[ins.tensor_key] = now
        elif op == Op.WAIT_CKPT:
            start = max(self.isend_time[ins.tensor_key], self.irecv_time[ins.tensor_key])
            arrival = start + c.p2p_checkpoint
            self._event(ins.peer, "network", start, arrival,
                        f"c{_piece_label(ins.stage, ins.sub, s.backward_split)}", "p2p", ins)
            self.clock[rank] = max(now, arrival)
        elif op == Op.OFFLOAD_GRAD:
            piece = (ins.stage, ins.sub)
            start = max(now, self.d2h_free[rank])
            end = start + c.grad_transfer[piece]
            self.d2h_free[rank] = self.grad_ready[piece] = end
            self._event(rank, "d2h", start, end,
                        f"g{_piece_label(*piece, s.backward_split)}", "offload", ins)
        elif op == Op.OPTIMIZER_START:
            piece = (ins.stage, ins.sub)
            start = max(now, self.grad_ready[piece], self.cpu_free[rank])
            end = start + c.optimizer[piece]
            self.cpu_free[rank] = end
            self._event(rank, "cpu-optimizer", start, end,
                        f"o{_piece_label(*piece, s.backward_split)}", "optimizer", ins)
        elif op == Op.OPTIMIZER_WAIT_ALL:
            self.clock[rank] = max(now, self.cpu_free[rank])

    def rendezvous(self, sender: int, send_index: int, receiver: int, recv_index: int) -> None:
        ins = self.schedule.programs[sender][send_index]
        start = max(self.clock[sender], self.clock[receiver])
        end = start + self.costs.p2p_activation
        self.clock[sender] = self.clock[receiver] = end
        label = "a" if ins.role == "act" else "g"
        self._event(sender, "network", start, end, f"{label}{ins.stage}", "p2p", ins)

    def collective(self, op: Op, indices: list[int]) -> None:
        ranks = range(self.schedule.ranks)
        if op == Op.OVERFLOW_SYNC:  # the check reads every offloaded gradient
            meet = max(max(self.clock[r], self.d2h_free[r]) for r in ranks)
        else:
            meet = max(self.clock)
        for rank in ranks:
            self.clock[rank] = meet


def _union_length_after(intervals: list[tuple[float, float]], after: float) -> float:
    total, reach = 0.0, after
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def simulate(schedule: Schedule, cost_model: CostModel) -> SimResult:
    """Validate `schedule`, then run it on `cost_model` (see module docstring)."""
    report = validate(schedule)
    simulator = _Simulator(schedule, cost_model)
    simulator.run()
    events = simulator.events
    iteration = max([*simulator.clock, *(e.end for e in events)])
    compute_end = max((e.end for e in events if e.resource == "compute"), default=0.0)
    ratios = tuple(1.0 - busy / iteration for busy in simulator.busy)
    optimizer = [(e.start, e.end) for e in events if e.resource == "cpu-optimizer"]
    return SimResult(
        schedule=schedule.name,
        iteration_time=iteration,
        busy=tuple(simulator.busy),
        bubble_ratio=ratios,
        mean_bubble_ratio=sum(ratios) / len(ratios),
        compute_end=compute_end,
        exposed_optimizer_time=_union_length_after(optimizer, compute_end),
        peak_params=report.peak_params,
        peak_checkpoints=report.peak_checkpoints,
        events=tuple(sorted(events, key=lambda e: (e.rank, e.start))),
    )
