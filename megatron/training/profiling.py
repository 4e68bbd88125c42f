"""Megatron's profiling flags: `--profile --use-pytorch-profiler` writes a torch profiler
trace of iterations [--profile-step-start, --profile-step-end) on the ranks of
--profile-ranks to --tensorboard-dir, as Megatron does (torch.profiler's
tensorboard_trace_handler: TensorBoard's profiler plugin or chrome://tracing read it). Each
pipeline instruction is a `PP:<cell>` range there, in the executor's grid abbreviations
(megatron/schedules/grid.py). `--profile` alone is Megatron's nsys mode: on CUDA the
CUDA profiler API is started and stopped around those iterations (run under
`nsys profile --capture-range=cudaProfilerApi`); on the CPU it does nothing.
"""

from __future__ import annotations

import torch

from megatron.config.run import RunConfig


class IterationProfiler:
    def __init__(self, run: RunConfig, rank: int) -> None:
        p = run.profiling
        chosen = p.profile and (not p.profile_ranks or rank in p.profile_ranks)  # (): all
        self._torch = chosen and p.use_pytorch_profiler
        self._nsys = chosen and not p.use_pytorch_profiler and torch.cuda.is_available()
        self.start, self.end = p.profile_step_start, p.profile_step_end
        self.trace_dir = run.logging.tensorboard_dir
        self._prof: torch.profiler.profile | None = None
        self._nsys_running = False

    def before(self, iteration: int) -> None:
        if iteration != self.start:
            return
        if self._torch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities, record_shapes=True, with_stack=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir))
            self._prof.start()
        elif self._nsys:
            torch.cuda.cudart().cudaProfilerStart()
            self._nsys_running = True

    def after(self, iteration: int) -> None:
        if iteration == self.end - 1:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when training stops before --profile-step-end)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()  # runs the trace handler: the file is written here
        if self._nsys_running:
            self._nsys_running = False
            torch.cuda.cudart().cudaProfilerStop()
