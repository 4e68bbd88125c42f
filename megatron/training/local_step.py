"""The whole model in one process: the reference every pipeline is checked against.

Working parameters in the training dtype, fp32 masters, torch's AdamW, all on the process's
device (the GPU on CUDA: what a user whose model fits would run); the same loss scaling,
clipping and no-decay rule as the pipeline's CPU optimizer. With
--pipeline-model-parallel-size 1 on several processes (Megatron's data parallelism), each
process is one replica: gradients and losses are averaged over the replicas, as device
tensors on megatron-core's data-parallel group (the gradients summed in the main gradients'
dtype, as the pipeline's replicas sum theirs: bf16 with --grad-reduce-in-bf16, as
Megatron-LM). The host reads two scalars an iteration (the loss and the gradient norm,
after every micro-batch), none per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.config.run import RunConfig
from megatron.models.llama import Batch, LlamaConfig, LlamaModel, uses_weight_decay
from megatron.optimizer.iteration_verdict import clip_factor
from megatron.pipeline.config import TORCH_DTYPES, LossScaling, working_dtype
from megatron.training.checkpoint_state import OwnedState, named_tensors
from megatron.training.train_step import StepResult


class LocalTrainStep:
    """Whole model in one process: working params in the training dtype, fp32 masters."""

    def __init__(self, model_cfg: LlamaConfig, run: RunConfig,
                 device: torch.device) -> None:
        self.dtype = working_dtype(run.precision)
        # what the micro-batches' gradients are summed in: the pipeline's main gradients
        self.main_grad_dtype = TORCH_DTYPES[run.precision.host_gradient_dtype]
        self.model_cfg = model_cfg
        self.device = device
        self._host_states: dict[str, tuple[torch.Tensor, ...]] | None = None  # see owned_state
        # Initialize in fp32 so every precision starts from the same master weights (built
        # on the host, each piece from its own seed, then moved: the same on every device).
        self.model = LlamaModel(model_cfg.with_dtype(torch.float32)).to(device)
        named = [(n, p) for n, p in self.model.named_parameters()]
        self.masters = [p.detach().clone().float() for _, p in named]
        if self.dtype != torch.float32:
            self.model.to(self.dtype)
        self.params = [p for _, p in named]
        o = run.optimization
        decay = [m for (n, p), m in zip(named, self.masters) if uses_weight_decay(n, p)]
        no_decay = [m for (n, p), m in zip(named, self.masters) if not uses_weight_decay(n, p)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            fused=device.type == "cuda" or None,  # the fused kernel where there is one
        )
        self.clip_grad = o.clip_grad
        inject = run.testing.inject_overflow
        self.inject_overflow_at = inject[0] if inject else None
        scaling = LossScaling.of(run.precision)
        self.scaler = scaling.build() if scaling else None
        self.replicas = self._replica_group()

    @staticmethod
    def _replica_group():
        """The data-parallel group when there are several replicas, else None."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _mean_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        """Average across the data-parallel replicas (in place); one collective."""
        if self.replicas is not None:
            dist.all_reduce(values, group=self.replicas)
            values.div_(dist.get_world_size(self.replicas))
        return values

    def step(self, iteration: int, micro_batches: Sequence[Batch], lr: float,
             weight_decay: float) -> StepResult:
        for p in self.params:
            p.grad = None
        scale = self.scaler.scale if self.scaler else 1.0
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        sums = None  # the main gradients, when wider than the working dtype
        for batch in micro_batches:
            loss = self.model(batch) / len(micro_batches)
            (loss * scale).backward()
            total += loss.detach().float()
            if self.main_grad_dtype != self.dtype:  # each micro-batch's added, as the pipeline
                if sums is None:
                    sums = [torch.zeros_like(p, dtype=self.main_grad_dtype) for p in self.params]
                for main, p in zip(sums, self.params):
                    main.add_(p.grad)
                    p.grad = None
        if sums is None:
            sums = [p.grad.detach() for p in self.params]
        if self.inject_overflow_at == iteration:
            sums[0].view(-1)[0] = float("inf")
        if self.replicas is not None:  # summed in the main gradients' dtype, as the pipeline's
            flat = torch.cat([g.reshape(-1) for g in sums])  # replicas sum them, then averaged
            dist.all_reduce(flat, group=self.replicas)
            flat = flat.float().div_(dist.get_world_size(self.replicas))
            sums = list(torch.split(flat, [g.numel() for g in sums]))
            total = self._mean_over_replicas(total)
        grads_fp32 = [g.float() for g in sums]
        total = float(total)
        for master, grad in zip(self.masters, grads_fp32):
            master.grad = grad.view_as(master).div_(scale)
        grads = [m.grad for m in self.masters]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        overflow = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(overflow)
        # the scale after the update, as Megatron logs it (backed off on an overflow)
        logged_scale = self.scaler.scale if self.scaler else None
        if overflow:
            return StepResult(total, skipped=True, grad_norm=norm, loss_scale=logged_scale)
        clip = clip_factor(norm, self.clip_grad)
        if clip < 1.0:
            for g in grads:
                g.mul_(clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = weight_decay * group["wd_mult"]
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)
        return StepResult(total, grad_norm=norm, loss_scale=logged_scale)

    def evaluate(self, batches: Sequence[Sequence[Batch]]) -> float:
        """Mean loss over every micro-batch of `batches`, forward only."""
        with torch.no_grad():
            losses = [self.model(batch).double() for micro_batches in batches
                      for batch in micro_batches]
        mean = (torch.stack(losses).sum() / len(losses)).reshape(1)
        return float(self._mean_over_replicas(mean))

    def _live_states(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every parameter's master and torch AdamW's moments, on the device (the moments
        created as zeros before the first step, as AdamW itself would)."""
        views = {}
        for (name, _), master in zip(self.model.named_parameters(), self.masters):
            state = self.optimizer.state[master]
            if not state:
                state.update(step=self._step_count(0), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
            views[name] = (master, state["exp_avg"], state["exp_avg_sq"])
        return views

    def _step_count(self, step: int) -> torch.Tensor:
        # a fused AdamW keeps its step on the device, the others on the host
        on = self.device if self.optimizer.defaults.get("fused") else "cpu"
        return torch.tensor(float(step), device=on)

    def owned_state(self) -> OwnedState:
        """The masters and moments as host tensors (a checkpoint's are host tensors): the
        live ones on the CPU device layer, copies kept until `restored()` on a GPU."""
        live = self._live_states()
        if self.device.type == "cpu":
            self._host_states = None
            views = live
        else:
            self._host_states = {name: tuple(t.cpu() for t in ts) for name, ts in live.items()}
            views = self._host_states
        step = int(self.optimizer.state[self.masters[0]]["step"])
        return OwnedState(named_tensors(self.model_cfg, views), step,
                          self.scaler.state_dict() if self.scaler else None)

    def restored(self, optimizer_step: int, loss_scaler: dict | None, iteration: int,
                 speculation: dict | None = None) -> None:
        """After a checkpoint load filled `owned_state()`'s tensors in place (torch's AdamW
        does not speculate: `speculation` is not used)."""
        with torch.no_grad():
            if self._host_states is not None:  # filled copies: put back
                for name, live in self._live_states().items():
                    for device_tensor, host in zip(live, self._host_states[name]):
                        device_tensor.copy_(host)
            for master, p in zip(self.masters, self.params):
                self.optimizer.state[master]["step"] = self._step_count(optimizer_step)
                p.copy_(master)
        if self.scaler and loss_scaler is not None:
            self.scaler.load_state_dict(loss_scaler)
