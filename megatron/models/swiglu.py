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

Where that moment would still exceed attention's, the MLP runs over pieces of the
sequence (fc1, the SwiGLU in place, fc2 per piece, each piece's output copied into the
layer's output): the layer then holds its output and one piece's fc1 output, 2 x hidden +
(2 x FFN + hidden) / pieces per token. How many pieces is memory_model.swiglu_chunks' rule,
the one the planner prices: one wherever memory allows, since a GEMM over fewer rows may
pick another kernel on CUDA (the same bits on the CPU, tested; within the last bits of
megatron-core's, and of the recompute, on CUDA).

The layer spec names the class itself, not a ModuleSpec: megatron-core's TransformerLayer
then builds it with the config alone (for a ModuleSpec of any MLP class but its own it logs
a warning per layer); the class takes the local spec's fc1 and fc2 and megatron-core's
default tensor-parallel group, what the TransformerLayer hands its own MLP. The class is
built on first use (`no_grad_in_place_mlp`): importing megatron-core's transformer modules
when this module is imported would do so in every process that imports the model's code,
before it forks (a forked child of a process holding their threads' locks can hang).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.config.model import ModelConfig
from megatron.schedules.memory_model import swiglu_chunks


@functools.cache
def no_grad_in_place_mlp() -> type:
    """The MLP class the local layer spec names (see the module docstring)."""
    from megatron.core.transformer.mlp import MLP

    class NoGradInPlaceSwiGLUMLP(_InPlaceSwiGLU, MLP):
        """megatron-core's MLP (same parameters, same checkpoints); its forward without
        grad in place in fc1's output."""

    return NoGradInPlaceSwiGLUMLP


class _InPlaceSwiGLU:
    """The methods no_grad_in_place_mlp's class puts before megatron-core's MLP."""

    def __init__(self, config, submodules=None, **kwargs) -> None:
        if submodules is None:
            from megatron.core.models.gpt import gpt_layer_specs

            submodules = gpt_layer_specs.get_gpt_layer_local_spec(
                normalization="RMSNorm").submodules.mlp.submodules
        super().__init__(config, submodules, **kwargs)
        self._chunks_by_shape: dict[tuple[int, int, int], int] = {}

    def _in_place_applies(self, per_token_scale) -> bool:
        c = self.config
        return (not torch.is_grad_enabled() and per_token_scale is None
                and c.gated_linear_unit and c.activation_func is F.silu
                and not c.bias_activation_fusion and not c.use_te_activation_func
                and c.activation_func_clamp_value is None and not c.add_bias_linear)

    def _chunks(self, hidden_states: torch.Tensor) -> int:
        seq, batch = hidden_states.shape[0], hidden_states.shape[1]
        key = (seq, batch, hidden_states.element_size())
        if key not in self._chunks_by_shape:
            c = self.config
            shape = ModelConfig(
                name="custom", num_layers=1, hidden_size=c.hidden_size,
                ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
                num_query_groups=c.num_query_groups or c.num_attention_heads, seq_length=seq,
                vocab_size=None, kv_channels=c.kv_channels)
            self._chunks_by_shape[key] = swiglu_chunks(shape, seq * batch, seq, key[2])
        return self._chunks_by_shape[key]

    def _in_place(self, hidden_states: torch.Tensor):
        fc1, _ = self.linear_fc1(hidden_states)  # no bias: add_bias_linear is off
        gate, up = torch.chunk(fc1, 2, dim=-1)
        F.silu(gate, inplace=True)
        up.add_(self.config.glu_linear_offset)
        gate.mul_(up)
        del fc1, up
        return self.linear_fc2(gate)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._in_place_applies(per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        chunks = self._chunks(hidden_states)
        if chunks == 1:
            return self._in_place(hidden_states)
        output, bias, start = None, None, 0
        for piece in torch.chunk(hidden_states, chunks, dim=0):
            piece_output, bias = self._in_place(piece)
            if output is None:
                output = piece_output.new_empty(
                    (hidden_states.shape[0], *piece_output.shape[1:]))
            output[start:start + piece.shape[0]].copy_(piece_output)
            start += piece.shape[0]
            del piece_output
        return output, bias
