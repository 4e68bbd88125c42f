"""Runs one rank's instruction list of a schedule on real processes.

Every schedule (decoupled, mobius, interleaved-1f1b, 1f1b, gpipe) goes through this one
interpreter, so they are compared on equal terms. What each instruction does:

- PREFETCH_PARAMS / RELEASE_PARAMS: copy a backward stage's 16-bit (or fp32) parameters
  from the node's shared-memory store into a slot of the device parameter buffer on the
  H2D stream; release the slot after the last compute that uses it.
- FORWARD (stage, mb): without autograd, through the stage's backward stages in order,
  keeping the activation checkpoint at the input of each one; the last stage's forward
  yields the micro-batch's loss.
- BACKWARD (stage, sub, mb): recompute from the checkpoint at the backward stage's input,
  then back-propagate the gradient from the next backward stage (or the loss); parameter
  gradients accumulate in the owner's flat device gradient buffer over micro-batches.
- SEND/RECV_ACT, SEND/RECV_GRAD: blocking; ISEND/IRECV_CKPT: asynchronous, WAIT_CKPT just
  before the recompute that needs it.
- OFFLOAD_GRAD: D2H copy of the stage's accumulated gradients; its event is the "ready"
  signal of the stage's CPU optimizer task.
- OPTIMIZER_START: decoupled: the stage's CPU AdamW task (validate locally, update, write
  the new working copy into the store) starts as soon as the gradients have landed.
  Synchronous baselines: the task only checks the gradient (S Fig. 3), the update waits.
- OPTIMIZER_WAIT_ALL (+ OVERFLOW_SYNC / POST_STEP_SYNC / ROLLBACK_IF_OVERFLOW): one
  all-reduce of the overflow flags; rollback (decoupled) or the deferred update (sync).

The time on the compute stream, the exposed optimizer time (the main thread waiting for
optimizer work) and the rest (bubbles: waiting for peers, parameters, checkpoints) are
measured with the device layer's events per iteration.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.offload.device import DeviceLayer, Event
from megatron.offload.grad_offload import GradientOffloader, GradientsReady
from megatron.offload.layout import bind_gradients
from megatron.offload.param_store import ParameterStore
from megatron.offload.prefetch import ParamDoubleBuffer, Slot
from megatron.optimizer.async_optimizer import AsyncStageOptimizer, IterationResult
from megatron.pipeline.p2p import PointToPoint
from megatron.pipeline.stage_modules import StageModule
from megatron.schedules.instructions import Instruction, Op, Piece, Schedule
from megatron.schedules.timeline import TimedEvent

Batch = dict[str, torch.Tensor]
_COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD})
_OPTIMIZER_OPS = frozenset({Op.OPTIMIZER_START, Op.OPTIMIZER_WAIT_ALL, Op.OVERFLOW_SYNC,
                            Op.POST_STEP_SYNC, Op.ROLLBACK_IF_OVERFLOW})


class InstructionError(RuntimeError):
    """An instruction failed; the message names the rank and the instruction."""


@dataclass
class IterationStats:
    loss: float  # mean over micro-batches (0.0 on ranks without the last forward stage)
    result: IterationResult
    iteration_s: float
    compute_s: float
    exposed_optimizer_s: float
    events: list[TimedEvent] = field(default_factory=list)  # when recorded

    @property
    def bubble_s(self) -> float:
        return max(0.0, self.iteration_s - self.compute_s - self.exposed_optimizer_s)


@dataclass
class OwnedStage:
    """What the owner of a backward stage keeps: gradients and optimizer group indices."""

    grad: torch.Tensor  # flat, device, training dtype
    groups: tuple[int, ...]  # CPUAdamW group of the decayed / non-decayed elements
    split: int  # elements [0, split) are the first group
    offloaded: GradientsReady | None = None


class PipelineExecutor:
    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: dict[Piece, StageModule],
        store: ParameterStore,
        device: DeviceLayer,
        param_buffer: ParamDoubleBuffer,
        offloader: GradientOffloader,
        optimizer: AsyncStageOptimizer,
        owned: dict[Piece, OwnedStage],
        p2p: PointToPoint,
        loss_scale_fn: Callable[[], float],
        inject_overflow: tuple[int, Piece] | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.program = schedule.programs[rank]
        self.modules = modules
        self.store = store
        self.device = device
        self.params = param_buffer
        self.offloader = offloader
        self.optimizer = optimizer
        self.owned = owned
        self.p2p = p2p
        self.loss_scale_fn = loss_scale_fn
        self.inject_overflow = inject_overflow
        self._kept_ckpts = _checkpoints_kept_locally(self.program)
        self._fail_at = _failure_to_inject(rank)
        self.last_stage = schedule.forward_stages - 1
        self.head_piece = (self.last_stage, schedule.backward_split - 1)

    # --- one iteration -----------------------------------------------------------------

    def run_iteration(self, iteration: int, micro_batches: Sequence[Batch],
                      record_timeline: bool = False) -> IterationStats:
        if len(micro_batches) != self.schedule.micro_batches:
            raise ValueError(f"{len(micro_batches)} micro-batches, the schedule has "
                             f"{self.schedule.micro_batches}")
        self._iteration = iteration
        self._batches = micro_batches
        self._slots: dict[Piece, Slot] = {}
        self._acts: dict[tuple[int, int], torch.Tensor] = {}
        self._ckpts: dict[tuple[int, int, int], torch.Tensor] = {}
        self._pending_ckpts: dict[tuple[int, int, int], tuple[dist.Work, torch.Tensor]] = {}
        self._isends: list[tuple[dist.Work, torch.Tensor]] = []
        self._grads: dict[tuple[Piece, int], torch.Tensor] = {}
        self._losses: list[float] = []
        self._result: IterationResult | None = None
        for state in self.owned.values():
            state.grad.zero_()
            state.offloaded = None
        # (instruction, start event, end event) on the compute stream; (instruction, start,
        # end) in host seconds for the main thread's waits on the optimizer.
        computed: list[tuple[Instruction, Event, Event]] = []
        waited: list[tuple[Instruction, float, float]] = []
        start_event = self.device.compute_stream.record_event()
        start = time.perf_counter()
        for index, instr in enumerate(self.program):
            t0 = time.perf_counter()
            before = self.device.compute_stream.record_event() if instr.op in _COMPUTE else None
            try:
                if self._fail_at is not None and (iteration, index) >= self._fail_at[:2]:
                    self._inject_failure()
                self._execute(instr)
            except Exception as exc:
                raise InstructionError(
                    f"rank {self.rank}: instruction {index} ({instr}) of iteration {iteration} "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from exc
            if before is not None:
                computed.append((instr, before, self.device.compute_stream.record_event()))
            elif instr.op in _OPTIMIZER_OPS:
                waited.append((instr, t0, time.perf_counter()))
        for work, _ in self._isends:
            work.wait()
        for piece in list(self._slots):
            self.params.release(self._slots.pop(piece))
        if self._result is None:
            raise InstructionError(f"rank {self.rank}: the program has no OPTIMIZER_WAIT_ALL")
        self._publish(iteration)
        self.device.compute_stream.synchronize()
        iteration_s = time.perf_counter() - start
        compute_s = sum(end.time_s() - begin.time_s() for _, begin, end in computed)
        optimizer_s = sum(end - begin for _, begin, end in waited)
        events = self._timeline(start_event.time_s(), start, computed, waited) if record_timeline else []
        loss = sum(self._losses) / len(self._losses) if self._losses else 0.0
        return IterationStats(loss, self._result, iteration_s, compute_s, optimizer_s, events)

    def _timeline(self, origin_event_s: float, origin_host_s: float, computed, waited) -> list[TimedEvent]:
        """The iteration as timed events from its start (seconds), in the simulator's format."""
        events = []
        for instr, begin, end in computed:
            label = f"f{instr.stage}" if instr.op == Op.FORWARD else f"b{instr.stage},{instr.sub}"
            events.append(TimedEvent(self.rank, "compute", begin.time_s() - origin_event_s,
                                     end.time_s() - origin_event_s, label, instr.op.value.lower(),
                                     instr.stage, instr.sub, instr.mb))
        for instr, begin, end in waited:
            label = "opt" if instr.stage < 0 else f"o{instr.stage},{instr.sub}"
            events.append(TimedEvent(self.rank, "cpu-optimizer", begin - origin_host_s,
                                     end - origin_host_s, label, "optimizer",
                                     instr.stage, instr.sub))
        return events

    def _inject_failure(self) -> None:
        if self._fail_at[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("failure injected by MEGATRON_SYSX_TEST_FAIL")

    def _execute(self, instr: Instruction) -> None:
        op = instr.op
        if op == Op.PREFETCH_PARAMS:
            for piece in self.schedule.stage_pieces(instr.stage, instr.sub):
                if piece not in self._slots:
                    segment = self.store.get(piece)
                    segment.wait_version(self._iteration - 1)
                    self._slots[piece] = self.params.prefetch(piece, segment.params)
        elif op == Op.RELEASE_PARAMS:
            for piece in self.schedule.stage_pieces(instr.stage, instr.sub):
                slot = self._slots.pop(piece, None)
                if slot is not None:
                    self.params.release(slot)
        elif op == Op.FORWARD:
            self._forward(instr.stage, instr.mb)
        elif op == Op.BACKWARD:
            self._backward((instr.stage, instr.sub), instr.mb)
        elif op == Op.SEND_ACT:
            self.p2p.send(instr, self._acts.pop((instr.stage, instr.mb)))
        elif op == Op.RECV_ACT:
            self._acts[(instr.stage, instr.mb)] = self.p2p.recv(instr)
        elif op == Op.SEND_GRAD:
            self.p2p.send(instr, self._grads.pop(((instr.stage, instr.sub), instr.mb)))
        elif op == Op.RECV_GRAD:
            self._grads[((instr.stage, instr.sub), instr.mb)] = self.p2p.recv(instr)
        elif op == Op.ISEND_CKPT:
            key = (instr.stage, instr.sub, instr.mb)
            tensor = self._ckpts.pop(key)
            self._isends.append((self.p2p.isend(instr, tensor), tensor))
        elif op == Op.IRECV_CKPT:
            self._pending_ckpts[(instr.stage, instr.sub, instr.mb)] = self.p2p.irecv(instr)
        elif op == Op.WAIT_CKPT:
            key = (instr.stage, instr.sub, instr.mb)
            work, buffer = self._pending_ckpts.pop(key)
            work.wait()
            self._ckpts[key] = buffer
        elif op == Op.OFFLOAD_GRAD:
            self._offload((instr.stage, instr.sub))
        elif op == Op.OPTIMIZER_START:
            # Decoupled: the update runs now, overlapping later backward stages. Baselines
            # place this after their overflow sync; the optimizer object (mode "sync") then
            # only checks here and updates in finish_iteration(), after the all-reduce.
            self._submit((instr.stage, instr.sub))
        elif op == Op.OPTIMIZER_WAIT_ALL:
            self._result = self.optimizer.finish_iteration()
        elif op in (Op.OVERFLOW_SYNC, Op.POST_STEP_SYNC, Op.ROLLBACK_IF_OVERFLOW):
            pass  # part of finish_iteration(): one all-reduce, then rollback or update
        else:
            raise ValueError(f"unknown instruction {instr}")

    # --- compute -------------------------------------------------------------------------

    def _bind(self, piece: Piece) -> StageModule:
        stage = self.modules[piece]
        slot = self._slots.get(piece)
        if slot is None:
            raise RuntimeError(f"parameters of backward stage {piece} are not resident "
                               "(no PREFETCH_PARAMS before use)")
        self.params.bind(slot, stage.module, stage.layout)
        return stage

    def _forward(self, stage: int, mb: int) -> None:
        batch = self._batches[mb]
        hidden = None if stage == 0 else self._acts.pop((stage - 1, mb))
        with torch.no_grad():
            for sub in range(self.schedule.backward_split):
                if (stage, sub) != (0, 0):
                    self._keep_checkpoint((stage, sub, mb), hidden)
                hidden = self._bind((stage, sub))(hidden, batch)
        if stage == self.last_stage:
            self._losses.append(float(hidden))
        else:
            self._acts[(stage, mb)] = hidden

    def _keep_checkpoint(self, key: tuple[int, int, int], hidden: torch.Tensor) -> None:
        """Only for a local backward or for the ISEND_CKPT that follows."""
        if key in self._kept_ckpts:
            self._ckpts[key] = hidden

    def _backward(self, piece: Piece, mb: int) -> None:
        batch = self._batches[mb]
        module = self._bind(piece)
        state = self.owned[piece]
        bind_gradients(module.module, module.layout, state.grad)
        if piece == (0, 0):
            hidden_in = None
        else:
            hidden_in = self._ckpts.pop((*piece, mb)).detach().requires_grad_(True)
        with torch.enable_grad():
            out = module(hidden_in, batch)
            if piece == self.head_piece:
                scale = self.loss_scale_fn() / self.schedule.micro_batches
                (out * scale).backward()
            else:
                nxt = self.schedule.next_piece(piece)
                out.backward(self._grads.pop((nxt, mb)))
        if hidden_in is not None:
            self._grads[(piece, mb)] = hidden_in.grad
        if self.inject_overflow == (self._iteration, piece):
            state.grad[0] = float("inf")

    # --- gradients and the optimizer -----------------------------------------------------

    def _offload(self, piece: Piece) -> None:
        state = self.owned[piece]
        state.offloaded = self.offloader.offload(piece, state.grad)

    def _submit(self, piece: Piece) -> None:
        state = self.owned[piece]
        ready = state.offloaded
        assert ready is not None, f"OPTIMIZER_START of {piece} before its OFFLOAD_GRAD"
        out = self.store.get(piece).params
        bounds = ((0, state.split), (state.split, out.numel()))
        for group, (lo, hi) in zip(state.groups, bounds):
            if hi > lo:
                self.optimizer.submit(group, ready.host[lo:hi], ready=ready, out=out[lo:hi])

    def _publish(self, iteration: int) -> None:
        for piece, state in self.owned.items():
            if state.offloaded is not None:
                state.offloaded.release()
                state.offloaded = None
            self.store.get(piece).publish(iteration)


def _checkpoints_kept_locally(program: Sequence[Instruction]) -> frozenset:
    """(stage, sub, mb) of the checkpoints a forward on this rank must keep: those sent
    with ISEND_CKPT and those of local backwards that do not receive theirs."""
    received = {(i.stage, i.sub, i.mb) for i in program if i.op == Op.IRECV_CKPT}
    sent = {(i.stage, i.sub, i.mb) for i in program if i.op == Op.ISEND_CKPT}
    local = {(i.stage, i.sub, i.mb) for i in program if i.op == Op.BACKWARD} - received
    return frozenset(sent | local)


def _failure_to_inject(rank: int) -> tuple[int, int, str] | None:
    """Testing aid: MEGATRON_SYSX_TEST_FAIL=RANK,ITERATION,INSTRUCTION,raise|kill makes that
    rank raise (or SIGKILL itself) at that instruction, to test how the job goes down."""
    spec = os.environ.get("MEGATRON_SYSX_TEST_FAIL")
    if not spec:
        return None
    fail_rank, iteration, index, how = spec.split(",")
    return (int(iteration), int(index), how) if int(fail_rank) == rank else None
