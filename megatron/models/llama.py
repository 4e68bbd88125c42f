"""LLaMA-2 from megatron-core building blocks, as an ordered list of pieces.

Piece 0 is the embedding, pieces 1..L the decoder layers, piece L+1 the head (final RMSNorm,
output layer and the loss). Every piece has the same call signature,
`piece(hidden, batch) -> hidden` (the embedding ignores `hidden`, the head returns the
micro-batch's mean loss), so a pipeline stage is just a run of consecutive pieces and a
process builds only the pieces it runs.

Each piece is initialized from its own seed (model seed, piece index), so a piece built alone
in one process has the same weights as the same piece built inside the full model elsewhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.model import ModelConfig, head_dim
from megatron.models import rope
from megatron.models.attention import SDPAttention, core_attention_kernel, with_sdpa_core_attention
from megatron.models.rms_norm import RMSNorm
from megatron.models.swiglu import no_grad_in_place_mlp

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    rope_base: float = 10000.0
    rotary_percent: float = 1.0
    kv_channels: int | None = None  # None: hidden / heads
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    attention_backend: str = "auto"  # Megatron's --attention-backend (see layer_spec)

    @classmethod
    def from_model(cls, model: ModelConfig, vocab_size: int, seed: int) -> LlamaConfig:
        """The modules to build for `model` with the tokenizer's vocabulary resolved."""
        return cls(num_layers=model.num_layers, hidden_size=model.hidden_size,
                   ffn_hidden_size=model.ffn_hidden_size,
                   num_attention_heads=model.num_attention_heads,
                   num_query_groups=model.num_query_groups, vocab_size=vocab_size,
                   seq_length=model.seq_length, rope_base=model.rotary_base,
                   rotary_percent=model.rotary_percent, kv_channels=model.kv_channels,
                   norm_epsilon=model.norm_epsilon, init_method_std=model.init_method_std,
                   seed=seed, attention_backend=model.attention_backend)

    @property
    def num_pieces(self) -> int:
        return self.num_layers + 2

    @property
    def head_dim(self) -> int:
        return head_dim(self.hidden_size, self.num_attention_heads, self.kv_channels)

    def with_dtype(self, dtype: torch.dtype) -> LlamaConfig:
        return replace(self, params_dtype=dtype)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def layer_implementation(cuda_available: bool | None = None,
                         te_importable: bool | None = None) -> str:
    """"transformer_engine" (TE's layer spec) on CUDA when Transformer Engine imports,
    "local" (megatron-core's own modules) everywhere else. apex changes nothing: the
    local spec's RMSNorm is torch's on every device (apex's FusedLayerNorm is LayerNorm
    only). The arguments stand in for the machine in tests."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "local"
    if te_importable is None:
        te_importable = _importable("transformer_engine")
    return "transformer_engine" if te_importable else "local"


def transformer_config(cfg: LlamaConfig, initialize: bool = True):
    """megatron-core's config of the pieces; `initialize=False`: weights are allocated but
    not initialized (a structure whose parameters will point elsewhere: nothing is
    written, so the kernel gives them no memory, and no random numbers are drawn)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=cfg.params_dtype,
        pipeline_dtype=cfg.params_dtype,
        bf16=cfg.params_dtype == torch.bfloat16,
        fp16=cfg.params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        # The fusions are CUDA kernels; the unfused paths are exact on every device.
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def layer_spec(implementation: str | None = None, attention_backend: str = "auto"):
    """The decoder layer's megatron-core spec (`implementation`: layer_implementation()).

    Transformer Engine's spec brings its own attention kernels. The local spec's core
    attention is torch's SDPA (megatron.models.attention) unless `attention_backend`
    (Megatron's --attention-backend) asks for the unfused one; parameters are the same.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if (implementation or layer_implementation()) == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    # the norms autograd records alike on every device (megatron.models.rms_norm)
    # the SwiGLU and RoPE in place without grad (megatron.models.swiglu, .rope)
    rope.install()

    spec = replace(spec, submodules=replace(
        spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm,
        mlp=no_grad_in_place_mlp()))
    if core_attention_kernel(attention_backend) == "sdpa":
        return with_sdpa_core_attention(spec)
    return spec


def norm_module(implementation: str | None = None) -> type:
    """The RMSNorm module of the final norm, the one the layers use: TE's with TE's spec,
    else megatron.models.rms_norm's (megatron-core's transformer_block would take apex's
    FusedLayerNorm when apex imports, which asserts LayerNorm)."""
    if (implementation or layer_implementation()) == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return RMSNorm


class EmbeddingPiece(nn.Module):
    def __init__(self, cfg: LlamaConfig, tcfg) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import (
            LanguageModelEmbedding,
        )

        self.embedding = LanguageModelEmbedding(
            config=tcfg,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            position_embedding_type="rope",
        )

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        return self.embedding(input_ids=tokens, position_ids=position_ids)  # [s, b, h]


class DecoderLayerPiece(nn.Module):
    def __init__(self, cfg: LlamaConfig, tcfg, layer_number: int) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.transformer.spec_utils import build_module

        self.layer = build_module(layer_spec(attention_backend=cfg.attention_backend),
                                  config=tcfg, layer_number=layer_number)
        # SDPA attends causally by itself; the other kernels read a sequence x sequence mask.
        self._needs_mask = not isinstance(self.layer.self_attention.core_attention, SDPAttention)
        # No parameters: the frequencies are recomputed per sequence length and cached.
        self._rotary = RotaryEmbedding(
            kv_channels=tcfg.kv_channels,
            rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rope_base,
            use_cpu_initialization=True,
        )
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _rope_and_mask(self, seq_len: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (seq_len, str(device))
        if key not in self._cache:
            rope = self._rotary(seq_len).to(device)
            # True = masked: the causal mask as megatron-core's attention expects it.
            mask = torch.triu(
                torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1
            ) if self._needs_mask else None
            self._cache = {key: (rope, mask)}
        return self._cache[key]

    def forward(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        rope, mask = self._rope_and_mask(hidden.shape[0], hidden.device)
        out, _ = self.layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rope)
        return out


class HeadPiece(nn.Module):
    """Final RMSNorm, output projection, masked mean cross-entropy of the micro-batch."""

    def __init__(self, cfg: LlamaConfig, tcfg) -> None:
        super().__init__()
        from megatron.core import tensor_parallel

        self.final_layernorm = norm_module()(
            config=tcfg, hidden_size=cfg.hidden_size, eps=cfg.norm_epsilon
        )
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size,
            cfg.vocab_size,
            config=tcfg,
            init_method=tcfg.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
        )

    def token_losses(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits, _ = self.output_layer(self.final_layernorm(hidden))  # [s, b, V]
        # Same as GPTModel.compute_language_model_loss: [b, s] labels -> [s, b] -> [b, s].
        return vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).t()

    def forward(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        losses = self.token_losses(hidden, batch["labels"])
        mask = batch["loss_mask"].to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: no weight decay on biases and norm weights (1-D parameters)."""
    return param.dim() > 1 and not name.endswith(".bias")


def build_piece(cfg: LlamaConfig, index: int, initialize: bool = True) -> nn.Module:
    """Build piece `index` with weights that depend only on (cfg.seed, index)
    (`initialize=False`: left uninitialized, see transformer_config)."""
    if not 0 <= index < cfg.num_pieces:
        raise IndexError(f"piece index {index} out of range 0..{cfg.num_pieces - 1}")
    tcfg = transformer_config(cfg, initialize)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed * 100_003 + index)
        if index == 0:
            return EmbeddingPiece(cfg, tcfg)
        if index == cfg.num_layers + 1:
            return HeadPiece(cfg, tcfg)
        return DecoderLayerPiece(cfg, tcfg, layer_number=index)


def build_pieces(cfg: LlamaConfig, indices: Iterable[int], initialize: bool = True
                 ) -> nn.ModuleList:
    return nn.ModuleList(build_piece(cfg, i, initialize) for i in indices)


def run_pieces(pieces: Sequence[nn.Module], hidden: torch.Tensor | None, batch: Batch):
    for piece in pieces:
        hidden = piece(hidden, batch)
    return hidden


class LlamaModel(nn.Module):
    """The whole model as one module: all pieces, chained. Returns the mean loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pieces = build_pieces(cfg, range(cfg.num_pieces))

    def forward(self, batch: Batch) -> torch.Tensor:
        return run_pieces(self.pieces, None, batch)


def gpt_model_name(cfg: LlamaConfig, piece_index: int, local_name: str) -> str:
    """The name megatron-core's GPTModel gives to parameter `local_name` of a piece."""
    if piece_index == 0:
        return local_name  # embedding.word_embeddings.weight
    if piece_index == cfg.num_layers + 1:
        return ("decoder." if local_name.startswith("final_layernorm") else "") + local_name
    return f"decoder.layers.{piece_index - 1}." + local_name.removeprefix("layer.")


def to_gpt_model_state_dict(cfg: LlamaConfig, pieces: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """The full piece list's state, under megatron-core GPTModel's names."""
    return {
        gpt_model_name(cfg, index, name): tensor
        for index, piece in enumerate(pieces)
        for name, tensor in piece.state_dict().items()
        if "_extra_state" not in name
    }
