"""When to stop early and cleanly: `--exit-interval`, `--exit-duration-in-mins` and
`--exit-signal-handler` (--exit-signal, SIGTERM by default as in Megatron, and SIGUSR1: what
Slurm sends before a time limit or a preemption).

A signal only sets a flag: the iteration in flight finishes, then the loop saves a
checkpoint and every rank returns 0. A signal may reach the ranks at different times (or
only some of them), so after each iteration the ranks agree through one small all-reduce
(MAX) on the host group, never inside the per-micro-batch paths; the exit interval is the
same on every rank and needs no agreement.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator

import torch

from megatron.config.run import ExitConfig

# Always handled with --exit-signal-handler, besides --exit-signal: the Slurm example's signal.
SLURM_SIGNAL = signal.SIGUSR1


class ExitConditions:
    """Installs the signal handlers (restored by `close`) and decides after each iteration.

    `agree(flags)` all-reduces a small float tensor with MAX over every rank (None: one
    process)."""

    def __init__(self, conditions: ExitConfig, start_time: float,
                 agree: Callable[[torch.Tensor], None] | None) -> None:
        self.exit_interval = conditions.exit_interval
        self.deadline = (start_time + 60.0 * conditions.exit_duration_in_mins
                         if conditions.exit_duration_in_mins is not None else None)
        self.handles_signals = bool(conditions.exit_signal_handler)
        self.agree = agree
        self.start_time = start_time
        self._exit_line = ""  # what Megatron-LM prints for the stop reason() found
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        if self.handles_signals:
            for sig in {signal.Signals[conditions.exit_signal], SLURM_SIGNAL}:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signum  # acted on after the iteration in flight

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (the same answer on every rank), or None."""
        needs_agreement = self.handles_signals or self.deadline is not None
        flags = torch.tensor([float(self.received is not None),
                              float(self.deadline is not None and time.time() > self.deadline)])
        if needs_agreement and self.agree is not None:
            self.agree(flags)
        if flags[0] > 0:
            name = signal.Signals(self.received).name if self.received else "a signal"
            self._exit_line = f"exiting program after receiving {name}."
            return f"{name} received (on this or another rank)"
        if flags[1] > 0:
            minutes = (time.time() - self.start_time) / 60.0
            self._exit_line = f"exiting program after {minutes} minutes"
            return "--exit-duration-in-mins reached"
        if self.exit_interval and iteration % self.exit_interval == 0:
            self._exit_line = f"exiting program at iteration {iteration}"
            return f"--exit-interval {self.exit_interval} reached"
        return None

    def exit_line(self, iteration: int, reason: str) -> str:
        """The line of a stop: Megatron-LM 0.19's words first (what a requeue script greps
        for), then the iteration and `reason` (reason()'s answer)."""
        return f"{self._exit_line} (after iteration {iteration}: {reason})"

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Interrupt:
    """Ctrl-C (SIGINT, to one process or to torchrun's process group): the run stops where
    it is, without a checkpoint, and `main` turns whatever it unwinds into one line,
    `interrupted at iteration N`, and exit status 130 (a shell's code for SIGINT). A save
    in progress is never cut: `deferred()` around it holds the interrupt until the save
    returns, so a checkpoint is committed whole or not begun, never blamed on the disk.
    --exit-signal-handler with --exit-signal SIGINT replaces this handler for its run
    (Megatron's meaning: finish the iteration, save, exit 0)."""

    def __init__(self) -> None:
        self.received = False
        self.iteration = 0  # the iteration in flight
        self._deferring = 0
        self._pending = False
        self._previous: object = None

    def install(self) -> None:
        self.received, self._pending, self._deferring = False, False, 0
        self._previous = signal.signal(signal.SIGINT, self._on_signal)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame) -> None:
        self.received = True
        if self._deferring:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold an interrupt that comes in the body until the body returns."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if self._pending and not self._deferring:
                self._pending = False
                raise KeyboardInterrupt

    def line(self) -> str:
        return f"interrupted at iteration {self.iteration}"


INTERRUPT = Interrupt()
INTERRUPTED_STATUS = 130
