"""A LLaMA-2 model's shape, by Megatron-LM's flag names, and its parameter count.

What the cost and memory models price, what the planner searches over and what the run
configuration's model section holds; megatron/models builds the modules from it.
"""

from __future__ import annotations

from dataclasses import dataclass

# ZeRO-Infinity, section 3: mixed-precision Adam keeps 2 (fp16 params) + 2 (fp16 grads)
# + 4 (fp32 master) + 4 (momentum) + 4 (variance) = 16 bytes, plus 4 for an fp32 gradient
# copy on the host; ZeRO-Infinity's Table counts 20 bytes per parameter for model states.
MODEL_STATE_BYTES_PER_PARAM = 20
# The vocabulary the planner assumes when neither a flag nor a tokenizer gives one
# (LLaMA-2's).
PLANNING_VOCAB_SIZE = 32000


# The model's shape flags (Megatron's names): what a preset sets and, but for the sequence
# length, what a checkpoint must agree on.
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "seq_length", "vocab_size")
# The flags that shape the layers beyond the sizes, with Megatron-LM's defaults (dropout:
# LLaMA's 0, see README's table of differences).
ARCHITECTURE_DEFAULTS = {"kv_channels": None, "max_position_embeddings": None,
                         "rotary_base": 10000, "rotary_percent": 1.0, "norm_epsilon": 1e-5,
                         "init_method_std": 0.02, "make_vocab_size_divisible_by": 128,
                         "attention_dropout": 0.0, "hidden_dropout": 0.0,
                         "attention_backend": "auto"}
# --attention-backend values whose kernel materializes every head's sequence x sequence
# scores and probabilities (megatron-core's DotProductAttention, Transformer Engine's
# unfused attention); the others run a fused kernel that keeps one value per head and token.
UNFUSED_ATTENTION_BACKENDS = ("unfused", "local")


def materializes_attention_scores(attention_backend: str) -> bool:
    return attention_backend in UNFUSED_ATTENTION_BACKENDS


def head_dim(hidden_size: int, num_attention_heads: int, kv_channels: int | None) -> int:
    """Channels per attention head: --kv-channels, or hidden size / heads (Megatron's)."""
    return kv_channels or hidden_size // num_attention_heads


@dataclass(frozen=True)
class ModelConfig:
    name: str  # the preset it came from, or "custom"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int | None  # None: taken from the tokenizer
    kv_channels: int | None = None  # width of one attention head; None: hidden / heads
    max_position_embeddings: int | None = None  # None: seq_length
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # the share of each head's channels that RoPE rotates
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocabulary to a multiple
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_backend: str = "auto"  # Megatron's --attention-backend: the attention kernel

    @property
    def head_dim(self) -> int:
        return head_dim(self.hidden_size, self.num_attention_heads, self.kv_channels)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Megatron's padding of the tokenizer's vocabulary (tensor-parallel size 1): the
        embedding and output layer have this many rows."""
        multiple = self.make_vocab_size_divisible_by
        return -(-vocab_size // multiple) * multiple

    def parameters(self, vocab_size: int | None = None) -> ParameterCount:
        """The closed-form parameter count, with `vocab_size` rows (default: the planned
        vocabulary)."""
        return count_parameters(self.num_layers, self.hidden_size, self.ffn_hidden_size,
                                self.num_attention_heads, self.num_query_groups,
                                vocab_size or self.planned_vocab_size, self.kv_channels)

    @property
    def planned_vocab_size(self) -> int:
        """The vocabulary to plan with: this one, or LLaMA-2's when it is not known yet,
        padded as the run will pad it."""
        return self.padded_vocab_size(self.vocab_size or PLANNING_VOCAB_SIZE)


@dataclass(frozen=True)
class ParameterCount:
    embedding: int
    per_layer: int
    layers: int
    head: int  # final norm + output layer

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.head


def count_parameters(
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    vocab_size: int,
    kv_channels: int | None = None,
) -> ParameterCount:
    """Closed-form parameter count of our LLaMA-2 (no biases, untied embeddings, GQA)."""
    h = hidden_size
    d = head_dim(h, num_attention_heads, kv_channels)
    q_width, kv_width = num_attention_heads * d, num_query_groups * d
    attention = h * (q_width + 2 * kv_width) + q_width * h  # fused QKV + output projection
    mlp = 3 * h * ffn_hidden_size  # SwiGLU: gate and up (fused fc1) + down
    norms = 2 * h
    per_layer = attention + mlp + norms
    return ParameterCount(
        embedding=vocab_size * h,
        per_layer=per_layer,
        layers=num_layers * per_layer,
        head=h + vocab_size * h,
    )


def count_parameters_full_mha(
    num_layers: int, hidden_size: int, ffn_hidden_size: int, vocab_size: int
) -> int:
    """What the paper's size column appears to count: 4*h^2 attention (no GQA), no norms."""
    h = hidden_size
    return num_layers * (4 * h * h + 3 * h * ffn_hidden_size) + 2 * vocab_size * h
