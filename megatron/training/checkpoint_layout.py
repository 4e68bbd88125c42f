"""megatron-core's sharded layout of this project's model, as megatron-core itself builds it.

`GPTModel.sharded_state_dict()` (local layer spec, tensor parallel 1) gives every parameter
a ShardedTensor: its checkpoint key, global shape and offset. The decoder layers share one
key per kind with the layer index as a leading axis (`decoder.layers.mlp.linear_fc2.weight`,
global shape `(num_layers, ...)`), the norms take Transformer Engine's names, SwiGLU's fc1
is a factory that stores its gate and up halves as two chunks of one `[gate; up]` tensor,
and each linear layer adds a `_extra_state` object. A pipeline rank here owns arbitrary
layers (not one contiguous pipeline stage), so the layout is built piece by piece: each
piece's megatron-core module, built once on the meta device (no memory), is asked for its
sharded state dict with the layer offset that TransformerBlock.sharded_state_dict prepends.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

import torch

from megatron.models.llama import LlamaConfig, layer_spec, norm_module, transformer_config

LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


@lru_cache(maxsize=4)
def _meta_modules(cfg: LlamaConfig) -> dict:
    """One module of each kind of piece, on the meta device."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.spec_utils import build_module

    # The checkpoint always uses the local spec's layout (the TE spec's is the same on disk).
    tcfg = transformer_config(cfg)
    with torch.device("meta"):
        return {
            "embedding": LanguageModelEmbedding(
                config=tcfg, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                position_embedding_type="rope"),
            "layer": build_module(layer_spec("local"), config=tcfg, layer_number=1),
            "final_layernorm": norm_module("local")(config=tcfg, hidden_size=cfg.hidden_size,
                                             eps=cfg.norm_epsilon),
            "output_layer": tensor_parallel.ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, config=tcfg, init_method=tcfg.init_method,
                bias=False, skip_bias_add=False, gather_output=False),
        }


@lru_cache(maxsize=1024)
def _piece_layout(cfg: LlamaConfig, piece: str) -> dict:
    """megatron-core's sharded state dict of one piece (`embedding`, `layer.N`, `head`),
    keyed by GPTModel's state-dict names; the values hold meta tensors."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        sharded_state_dict_default,
    )

    modules, metadata = _meta_modules(cfg), ensure_metadata_has_dp_cp_group(None)
    if piece == "embedding":
        return modules["embedding"].sharded_state_dict(prefix="embedding.", metadata=metadata)
    if piece == "head":
        out = sharded_state_dict_default(modules["final_layernorm"], "decoder.final_layernorm.",
                                         (), metadata)
        head = modules["output_layer"].sharded_state_dict(prefix="output_layer.",
                                                          metadata=metadata)
        head.pop("output_layer._extra_state", None)  # GPTModel.sharded_state_dict drops it
        return {**out, **head}
    index = int(piece.split(".")[1])
    # TransformerBlock.sharded_state_dict: the layer's global index prepended as axis 0.
    prefix = f"decoder.layers.{index}."
    out = modules["layer"].sharded_state_dict(
        prefix=prefix, sharded_offsets=((0, index, cfg.num_layers),), metadata=metadata)
    replace_prefix_for_sharding(out, prefix, "decoder.layers.")
    return out


def piece_of(name: str) -> str:
    """Which piece holds GPTModel parameter `name`."""
    layer = LAYER.match(name)
    if layer:
        return f"layer.{layer.group(1)}"
    if name.startswith("embedding."):
        return "embedding"
    return "head"


def layout_of(cfg: LlamaConfig, names) -> dict:
    """megatron-core's ShardedTensor (or factory) for each GPTModel parameter in `names`,
    plus the `_extra_state` objects of the modules they belong to (megatron-core's load
    expects them). The values hold meta tensors: `with_data` gives them real ones."""
    out = {}
    for piece in sorted({piece_of(n) for n in names}):
        layout = _piece_layout(cfg, piece)
        wanted = {n for n in names if piece_of(n) == piece}
        modules = {n.rsplit(".", 1)[0] for n in wanted}
        for name, entry in layout.items():
            if name in wanted or (name.endswith("._extra_state")
                                  and name.rsplit(".", 1)[0] in modules):
                out[name] = entry
    missing = set(names) - out.keys()
    if missing:
        raise KeyError(f"not a parameter of megatron-core's GPTModel: {sorted(missing)[0]}")
    return out


def with_data(entry, tensor: torch.Tensor, prefix: str | None = None):
    """`entry` of layout_of() holding `tensor` (a live tensor or a buffer), under
    `prefix.KEY` when given (megatron-core's optimizer-state naming)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if prefix is not None:
        return make_sharded_optimizer_tensor(entry, tensor, prefix)
    if isinstance(entry, ShardedTensor):
        return replace(entry, data=tensor, dtype=tensor.dtype)
    return replace(entry, data=tensor)


def unstacked_names(key: str, leading: int) -> list[tuple[str, int | None]]:
    """(GPTModel name, layer index on the stacked axis or None) of every parameter stored
    under megatron-core key `key` (`leading`: its first dimension). The norms' names come
    back through the local layer spec's own key map, inverted."""
    if not key.startswith("decoder.layers."):
        return [(key, None)]
    rest = key[len("decoder.layers."):]
    keys_map = layer_spec("local").submodules.sharded_state_dict_keys_map
    for ours, theirs in keys_map.items():
        if rest.startswith(theirs):
            rest = ours + rest[len(theirs):]
            break
    return [(f"decoder.layers.{i}.{rest}", i) for i in range(leading)]
