"""Discrete-event simulation of one iteration of a schedule under a cost model.

Per rank, the program runs in order on a host thread whose clock advances with compute
(FORWARD/BACKWARD occupy the compute stream synchronously), with blocking
communication (a rendezvous: both sides leave at max(arrivals) + transfer, the latency
included), each instruction, of every kind alike, first paying the cost model's host
time of its dispatch (`instruction`) on its rank's clock. Parallel
resources per rank: an H2D stream (PREFETCH_PARAMS, compute waits for its parameters), a
D2H stream (OFFLOAD_GRAD), and a CPU optimizer lane (OPTIMIZER_START runs once its
gradients are home; the node's CPU throughput is split among its GPUs). The lane runs its
updates one after the other (FIFO), or, when one update alone reaches only a share of the
lane's rate (the cost model's `single_update_share` < 1: an update on its own thread),
side by side, each at min(share, 1 / updates in progress) of it. Checkpoint
transfers start when both ISEND and IRECV are posted; links are not contended. Optimizer
states on NVMe: READ/WRITE_OPTIMIZER_STATES queue on their node's drive (one per node,
shared by its ranks), a read waits for a free buffer of the rank's window (the
validator's peak), the step waits for its read, the write follows the step and frees its
buffer when done.

Bubble ratio of a rank (SysX Eq. 1-3): idle compute time over the iteration time,
1 - busy / iteration_time. Exposed optimizer time: the part of the optimizer's work (the
CPU lane, and for OPTIMIZER_START_SUBGROUPS the device subgroups' copies and updates) that
lies after the last forward/backward of the iteration (nothing left to hide it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_model import CostModel
from .instructions import OP_SPECS, WHOLE_STAGE, BackwardStage, Instruction, Op, Schedule
from .interpreter import Interpreter
from .optimizer_stride import device_share
from .timeline import TimedEvent
from .validator import ValidationReport, validate


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
    # optimizer states on NVMe: the drives' reads and writes after the last compute, and
    # the busiest node drive's time per iteration (it keeps up while below the iteration)
    exposed_state_io_time: float = 0.0
    state_io_busy_time: float = 0.0

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


def _label(stage: int, sub: int, split: int) -> str:
    return f"{stage}" if split == 1 or sub < 0 else f"{stage},{sub}"


class _StateDrives:
    """The NVMe tier's part of the simulation: one drive per node that its ranks' reads and
    writes queue on, and each rank's window of host buffers (the validator's peak), which a
    read waits for and a completed write frees."""

    def __init__(self, costs: CostModel, window: tuple[int, ...], ranks: int) -> None:
        self.costs = costs
        self.free_at: dict[int, float] = {}  # per node
        self.buffers_free_at = [[0.0] * n for n in (window or [0] * ranks)]
        self.ready: dict[BackwardStage, float] = {}  # a stage's states in host memory

    def _queue(self, rank: int, ready: float, seconds: float) -> tuple[float, float]:
        node = rank // max(1, self.costs.disk.ranks_per_node)
        start = max(ready, self.free_at.get(node, 0.0))
        self.free_at[node] = start + seconds
        return start, start + seconds

    def read(self, rank: int, b: BackwardStage, clock: float) -> tuple[float, float]:
        """A read into the rank's first free buffer, posted at `clock`: (start, end)."""
        slots = self.buffers_free_at[rank]
        slot = slots.index(min(slots))
        start, end = self._queue(rank, max(clock, slots.pop(slot)), self.costs.disk.read[b])
        self.ready[b] = end
        return start, end

    def write(self, rank: int, b: BackwardStage, stepped: float) -> tuple[float, float]:
        """The write after the step that ended at `stepped`: (start, end), which frees its
        buffer."""
        start, end = self._queue(rank, stepped, self.costs.disk.write[b])
        self.buffers_free_at[rank].append(end)
        return start, end


def shared_lane_ends(jobs: list[tuple[float, float]], share: float) -> list[float]:
    """When each update (arrival, seconds at the lane's full rate) of one CPU lane ends,
    the updates in progress sharing the lane: n of them each advance at min(share, 1 / n)
    of its rate (share 1: the lane is always fully used, as FIFO)."""
    ends = [0.0] * len(jobs)
    pending = sorted(range(len(jobs)), key=lambda j: jobs[j][0])
    left = {}
    clock = 0.0
    while pending or left:
        if not left:
            clock = max(clock, jobs[pending[0]][0])
        while pending and jobs[pending[0]][0] <= clock:
            j = pending.pop(0)
            left[j] = jobs[j][1]
        rate = min(share, 1.0 / len(left))
        done = clock + min(left.values()) / rate
        step = min(done, jobs[pending[0]][0]) if pending else done
        for j in left:
            left[j] -= rate * (step - clock)
        clock = step
        for j in [j for j, work in left.items() if work <= 1e-12 * max(1.0, jobs[j][1])]:
            ends[j] = clock
            del left[j]
    return ends


class _OptimizerLane:
    """The optimizer's part of the simulation: each rank's CPU optimizer lane (a step
    starts once its gradients are home; FIFO, or shared: `shared_lane_ends`), the device
    subgroups' copies and updates, and the states' reads and writes on the node's drive.
    The handlers are the simulator's, for the optimizer's ops; the rank's clock and copy
    streams are the simulator's."""

    def __init__(self, simulator: _Simulator, window: tuple[int, ...]) -> None:
        ranks = range(simulator.schedule.ranks)
        self.sim = simulator
        self.cpu_free = [0.0 for _ in ranks]
        self.device_free = [0.0 for _ in ranks]  # device subgroups flushed
        self.drives = _StateDrives(simulator.costs, window, simulator.schedule.ranks)
        self.step_end: dict[BackwardStage, float] = {}
        costs = simulator.costs
        # side by side only for plain host updates (the drives' and the subgroups' timing
        # follows each step's end as it is posted)
        self.shared = (costs.single_update_share < 1.0 and costs.disk is None
                       and costs.device_update is None)
        self.jobs: list[list[tuple[float, float, Instruction]]] = [[] for _ in ranks]

    def _settle(self, rank: int) -> None:
        """The rank's lane free when all its posted updates end (shared lane)."""
        if self.shared and self.jobs[rank]:
            jobs = [(start, work) for start, work, _ in self.jobs[rank]]
            self.cpu_free[rank] = max(shared_lane_ends(jobs, self.sim.costs.single_update_share))

    def finish(self) -> None:
        """The shared lanes' updates as events, once every one is posted."""
        if not self.shared:
            return
        for rank, posted in enumerate(self.jobs):
            ends = shared_lane_ends([(start, work) for start, work, _ in posted],
                                    self.sim.costs.single_update_share)
            for (start, _, ins), end in zip(posted, ends):
                b = BackwardStage(ins.stage, ins.sub)
                self.step_end[b] = end
                self.sim.event(rank, "cpu-optimizer", start, end,
                               f"o{_label(*b, self.sim.schedule.backward_split)}", "optimizer",
                               ins)

    def _optimizer_start(self, rank: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        if self.shared:
            start = max(self.sim.clock[rank], self.sim.grad_ready[b])
            self.jobs[rank].append((start, self.sim.costs.optimizer[b], ins))
            return
        start = max(self.sim.clock[rank], self.sim.grad_ready[b], self.cpu_free[rank],
                    self.drives.ready.get(b, 0.0))
        end = start + self.sim.costs.optimizer[b]
        self.cpu_free[rank] = self.step_end[b] = end
        self.sim.event(rank, "cpu-optimizer", start, end,
                       f"o{_label(*b, self.sim.schedule.backward_split)}", "optimizer", ins)

    def _optimizer_start_subgroups(self, rank: int, ins: Instruction) -> None:
        """The split's share of the stage on the device (1/K, or (N-1)/N for device:N):
        the loads back to back on the H2D stream (after any prefetch queued there), each
        flush right behind its update on the D2H stream (after any offload), full duplex;
        the CPU lane does the rest."""
        b = BackwardStage(ins.stage, ins.sub)
        device = self.sim.costs.device_update
        if device is None or device.stride == 0:
            self._optimizer_start(rank, ins)
            return
        share = device_share(device.stride)
        ready = max(self.sim.clock[rank], self.sim.grad_ready[b], self.drives.ready.get(b, 0.0))
        start = max(ready, self.cpu_free[rank])
        self.cpu_free[rank] = start + self.sim.costs.optimizer[b] * (1.0 - share)
        label = _label(*b, self.sim.schedule.backward_split)
        self.sim.event(rank, "cpu-optimizer", start, self.cpu_free[rank], f"o{label}",
                       "optimizer", ins)
        on_device = device.params[b] * share
        moves = 3.0 * on_device / device.rates.h2d_params_per_s
        update = on_device / device.rates.gpu_update_params_per_s
        load = max(ready, self.sim.h2d_free[rank])
        self.sim.h2d_free[rank] = load + moves
        flush = max(load + update, self.sim.d2h_free[rank])
        self.sim.d2h_free[rank] = flush + moves
        self.device_free[rank] = max(self.device_free[rank], self.sim.d2h_free[rank])
        self.step_end[b] = max(self.cpu_free[rank], self.sim.d2h_free[rank])
        self.sim.event(rank, "h2d", load, load + moves, f"s{label}", "optimizer", ins)
        self.sim.event(rank, "device-optimizer", load, load + moves + update, f"u{label}",
                       "optimizer", ins)
        self.sim.event(rank, "d2h", flush, flush + moves, f"s{label}", "optimizer", ins)

    def _read_optimizer_states(self, rank: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        start, end = self.drives.read(rank, b, self.sim.clock[rank])
        self.sim.event(rank, "disk", start, end,
                       f"r{_label(*b, self.sim.schedule.backward_split)}", "state-io", ins)

    def _write_optimizer_states(self, rank: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        start, end = self.drives.write(rank, b, self.step_end[b])
        self.sim.event(rank, "disk", start, end,
                       f"w{_label(*b, self.sim.schedule.backward_split)}", "state-io", ins)

    def _optimizer_wait_all(self, rank: int, ins: Instruction) -> None:
        self._settle(rank)
        self.sim.clock[rank] = max(self.sim.clock[rank], self.cpu_free[rank],
                                   self.device_free[rank])

    def _rollback_if_overflow(self, rank: int, ins: Instruction) -> None:
        """The expected cost of corrections (cost model's `rollback`, 0: no overflow)."""
        self._settle(rank)
        start = max(self.sim.clock[rank], self.cpu_free[rank])
        end = start + self.sim.costs.rollback
        self.sim.clock[rank] = self.cpu_free[rank] = end
        self.sim.event(rank, "cpu-optimizer", start, end, "rb", "optimizer", ins)


class _Simulator(Interpreter):
    """The clocks: compute, transfers, prefetches and offloads per rank; the optimizer's
    ops are `_OptimizerLane`'s."""

    handler_parts = (_OptimizerLane,)

    def __init__(self, schedule: Schedule, costs: CostModel,
                 params_arrive: dict[tuple[int, BackwardStage], float] | None = None,
                 window: tuple[int, ...] = ()) -> None:
        super().__init__(schedule)
        ranks = range(schedule.ranks)
        self.costs = costs
        self.params_arrive = params_arrive or {}
        self.clock = [0.0 for _ in ranks]
        self.h2d_free = [0.0 for _ in ranks]
        self.d2h_free = [0.0 for _ in ranks]
        self.param_ready = [{} for _ in ranks]
        self.grad_ready: dict = {}
        self.isend_time: dict = {}
        self.irecv_time: dict = {}
        self.busy = [0.0 for _ in ranks]
        self.events: list[TimedEvent] = []
        self.optimizer = _OptimizerLane(self, window)

    def _handler(self, op: Op):
        """The simulator's own cost for `op`, or the optimizer lane's for its ops."""
        method = OP_SPECS[op].method
        return getattr(self, method, None) or getattr(self.optimizer, method)

    def event(self, rank: int, resource: str, start: float, end: float, label: str, kind: str,
              ins: Instruction) -> None:
        if end > start:
            self.events.append(TimedEvent(rank, resource, start, end, label, kind,
                                          ins.stage, ins.sub, ins.mb))

    def _compute(self, rank: int, ins: Instruction) -> None:
        s, c = self.schedule, self.costs
        if ins.op == Op.FORWARD:
            uses = s.params_of(ins.stage, WHOLE_STAGE)
            duration = c.forward[ins.stage]
            label, kind = f"f{ins.stage}", "forward"
        else:
            uses = [BackwardStage(ins.stage, ins.sub)]
            duration = c.recompute[uses[0]] + c.backward[uses[0]]
            label = f"b{_label(ins.stage, ins.sub, s.backward_split)}"
            kind = "backward"
        start = max([self.clock[rank]] + [self.param_ready[rank][b] for b in uses])
        self.clock[rank] = start + duration
        self.busy[rank] += duration
        self.event(rank, "compute", start, start + duration, label, kind, ins)

    _forward = _backward = _compute

    def local(self, rank: int, index: int, ins: Instruction) -> None:
        self.clock[rank] += self.costs.instruction  # the host's dispatch, before it takes effect
        self._handler(ins.op)(rank, ins)

    def _prefetch(self, rank: int, ins: Instruction) -> None:
        s, c = self.schedule, self.costs
        covered = s.params_of(ins.stage, ins.sub)
        start = max([self.clock[rank], self.h2d_free[rank]]
                    + [self.params_arrive.get((rank, b), 0.0) for b in covered])
        end = start + sum(c.param_transfer[b] for b in covered)
        self.h2d_free[rank] = end
        for b in covered:
            self.param_ready[rank][b] = end
        label = f"p{_label(ins.stage, ins.sub, s.backward_split)}"
        self.event(rank, "h2d", start, end, label, "prefetch", ins)

    def _release(self, rank: int, ins: Instruction) -> None:
        for b in self.schedule.params_of(ins.stage, ins.sub):  # the slot is free again
            self.param_ready[rank].pop(b, None)

    def _isend_act_ckpt(self, rank: int, ins: Instruction) -> None:
        self.isend_time[ins.tensor_key] = self.clock[rank]

    def _irecv_act_ckpt(self, rank: int, ins: Instruction) -> None:
        self.irecv_time[ins.tensor_key] = self.clock[rank]

    def _wait_act_ckpt(self, rank: int, ins: Instruction) -> None:
        start = max(self.isend_time[ins.tensor_key], self.irecv_time[ins.tensor_key])
        arrival = start + self.costs.p2p_checkpoint
        self.event(ins.peer, "network", start, arrival,
                   f"c{_label(ins.stage, ins.sub, self.schedule.backward_split)}", "p2p", ins)
        self.clock[rank] = max(self.clock[rank], arrival)

    def _offload(self, rank: int, ins: Instruction) -> None:
        b = BackwardStage(ins.stage, ins.sub)
        start = max(self.clock[rank], self.d2h_free[rank])
        end = start + self.costs.grad_transfer[b]
        self.d2h_free[rank] = self.grad_ready[b] = end
        self.event(rank, "d2h", start, end,
                   f"g{_label(*b, self.schedule.backward_split)}", "offload", ins)

    def rendezvous(self, sender: int, send_index: int, receiver: int, recv_index: int) -> None:
        ins = self.schedule.programs[sender][send_index]
        for rank in (sender, receiver):  # each side's dispatch of its instruction
            self.clock[rank] += self.costs.instruction
        getattr(self, OP_SPECS[ins.op].method)(sender, receiver, ins)

    def _transfer(self, sender: int, receiver: int, ins: Instruction) -> None:
        start = max(self.clock[sender], self.clock[receiver])
        end = start + self.costs.p2p_activation
        self.clock[sender] = self.clock[receiver] = end
        label = "a" if ins.role == "act" else "g"
        self.event(sender, "network", start, end, f"{label}{ins.stage}", "p2p", ins)

    # A receive is timed together with its send, in the rendezvous.
    _send_activation = _send_gradient = _recv_activation = _recv_gradient = _transfer

    def collective(self, op: Op, indices: list[int]) -> None:
        for rank in range(self.schedule.ranks):  # every rank's dispatch of its instruction
            self.clock[rank] += self.costs.instruction
        meet = getattr(self, OP_SPECS[op].method)()
        for rank in range(self.schedule.ranks):
            self.clock[rank] = meet

    def _overflow_sync(self) -> float:
        """Meets when every rank's gradients are home: the check reads all of them."""
        return max(max(clock, d2h) for clock, d2h in zip(self.clock, self.d2h_free))

    def _post_step_sync(self) -> float:
        return max(self.clock)



def _union_length_after(intervals: list[tuple[float, float]], after: float) -> float:
    total, reach = 0.0, after
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def simulate(schedule: Schedule, cost_model: CostModel,
             report: ValidationReport | None = None,
             params_arrive: dict[tuple[int, BackwardStage], float] | None = None) -> SimResult:
    """Validate `schedule` (unless its `report` is given), then run it on `cost_model` (see
    module docstring). `params_arrive[(rank, b)]`: the time before which the rank's host copy
    of backward stage b is not there yet, so no prefetch of it starts (parameters still on
    their way from another node, see distribution.py); by default all are there at 0."""
    report = report if report is not None else validate(schedule)
    if report.peak_optimizer_states and cost_model.disk is None:
        raise ValueError(f"schedule {schedule.name!r} keeps optimizer states on disk; the "
                         "cost model prices no disk")
    simulator = _Simulator(schedule, cost_model, params_arrive, report.peak_optimizer_states)
    simulator.run()
    simulator.optimizer.finish()
    events = simulator.events
    iteration = max([*simulator.clock, *(e.end for e in events)])
    compute_end = max((e.end for e in events if e.resource == "compute"), default=0.0)
    ratios = tuple(1.0 - busy / iteration for busy in simulator.busy)
    optimizer = [(e.start, e.end) for e in events if e.kind == "optimizer"]
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
        exposed_state_io_time=_union_length_after(
            [(e.start, e.end) for e in events if e.resource == "disk"], compute_end),
        state_io_busy_time=_busiest_drive(events, cost_model),
    )


def _busiest_drive(events: list[TimedEvent], costs: CostModel) -> float:
    busy: dict[int, float] = {}
    for e in events:
        if e.resource == "disk":
            node = e.rank // max(1, costs.disk.ranks_per_node)
            busy[node] = busy.get(node, 0.0) + e.end - e.start
    return max(busy.values(), default=0.0)
