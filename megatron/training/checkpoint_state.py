"""What a checkpoint holds, by name, whatever process and layout holds it now.

Every tensor is keyed by megatron-core GPTModel's parameter name under one of three
prefixes: the master (`model.`) and Adam's two moments (`optimizer.exp_avg.`,
`optimizer.exp_avg_sq.`), each in the precision the run keeps it in (fp32, or bf16 with
--master-dtype / --optimizer-state-dtype bf16; a load converts). These are the names the
train steps and tools speak; on disk checkpointing.py stores them under megatron-core's
sharded keys (GPTModel's key, `optimizer.state.exp_avg.KEY`, ...; checkpoint_layout). A train step hands out
the tensors it owns as live host tensors (`OwnedState`): saving copies them, loading fills them in place and then calls
`restored()` so the step can publish the new masters to its working copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.models.llama import LlamaConfig, gpt_model_name

MASTER = "model."
EXP_AVG = "optimizer.exp_avg."
EXP_AVG_SQ = "optimizer.exp_avg_sq."
STATE_PREFIXES = (MASTER, EXP_AVG, EXP_AVG_SQ)

# Transformer Engine's layer spec fuses each RMSNorm into the linear layer after it; the
# checkpoint always uses the local spec's names so CPU and GPU runs read each other.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def checkpoint_name(cfg: LlamaConfig, model_name: str) -> str:
    """GPTModel's name of a LlamaModel parameter (`pieces.N.rest`)."""
    _, index, rest = model_name.split(".", 2)
    name = gpt_model_name(cfg, int(index), rest)
    for te, local in _TE_TO_LOCAL.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


@dataclass
class OwnedState:
    """The tensors one train step owns (live: copy before the next step) and its scalars."""

    tensors: dict[str, torch.Tensor]  # prefix + GPTModel name -> fp32 host tensor
    optimizer_step: int
    loss_scaler: dict | None
    # What decides how the CPU optimizer's next iteration speculates: the clip factor of
    # the last iteration that did not overflow, the clean iterations in a row
    # (AsyncGroupOptimizer.state_dict). Without it a resumed run is not bit-exact.
    speculation: dict | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def named_tensors(cfg: LlamaConfig, views: dict[str, tuple[torch.Tensor, ...]]
                  ) -> dict[str, torch.Tensor]:
    """{LlamaModel name: (master, exp_avg, exp_avg_sq)} -> the checkpoint's keys."""
    out = {}
    for model_name, triple in views.items():
        name = checkpoint_name(cfg, model_name)
        for prefix, tensor in zip(STATE_PREFIXES, triple):
            out[prefix + name] = tensor
    return out
