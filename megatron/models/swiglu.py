"""megatron-core's MLP with its SwiGLU computed in place when autograd is off.

The forward without grad (the pass whose backward recomputes it) is where a layer holds the
most beyond the checkpoints: megatron-core's SwiGLU makes fc1's output, silu(gate), the up
half plus its offset and their product, 5 x FFN per token. Nothing is saved without grad,
so the same operations can run in fc1's output: silu in place on the gate half, the offset
added in place to the up half, their product written into the gate half, fc2 reading that
half as a strided view (its rows 2 x FFN apart: a GEMM with that leading dimension, no
copy). Each operation is the one megatron-core runs, on the same values, so the output is
bit for bit megatron-core's; the layer holds fc1's output alone, 2 x FFN per token. With
autograd on, and for any MLP configuration other than this project's bias-free SwiGLU,
megatron-core's forward runs unchanged.

The layer spec names the class itself, not a ModuleSpec: megatron-core's TransformerLayer
then builds it with the config alone (for a ModuleSpec of any MLP class but its own it logs
a warning per layer); the class takes the local spec's fc1 and fc2 and megatron-core's
default tensor-parallel group, what the TransformerLayer hands its own MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class NoGradInPlaceSwiGLUMLP(MLP):
    """megatron-core's MLP (same parameters, same checkpoints); see the module docstring."""

    def __init__(self, config, submodules=None, **kwargs) -> None:
        if submodules is None:
            from megatron.core.models.gpt import gpt_layer_specs

            submodules = gpt_layer_specs.get_gpt_layer_local_spec(
                normalization="RMSNorm").submodules.mlp.submodules
        super().__init__(config, submodules, **kwargs)

    def _in_place_applies(self, per_token_scale) -> bool:
        c = self.config
        return (not torch.is_grad_enabled() and per_token_scale is None
                and c.gated_linear_unit and c.activation_func is F.silu
                and not c.bias_activation_fusion and not c.use_te_activation_func
                and c.activation_func_clamp_value is None and not c.add_bias_linear)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._in_place_applies(per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1, _ = self.linear_fc1(hidden_states)  # no bias: add_bias_linear is off
        gate, up = torch.chunk(fc1, 2, dim=-1)
        F.silu(gate, inplace=True)
        up.add_(self.config.glu_linear_offset)
        gate.mul_(up)
        del fc1, up
        return self.linear_fc2(gate)
