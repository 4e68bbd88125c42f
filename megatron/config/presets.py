"""Model presets: the SysX paper's LLaMA-2 configurations (Table 2) and CPU-sized ones.

Table 2 gives layers, hidden size, FFN size and KV heads, but not the number of attention
heads. We keep LLaMA-2's head dimension of 128 where the KV heads divide the resulting head
count, and otherwise take the head count whose head dimension is closest to 128 (40B: 64
heads of 92, 52B: 64 of 104, 69B: 64 of 120, 110B: 48 of 144). The head count changes the
parameter count only through the KV projection width (kv_heads * head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.config.model import ModelConfig

# LLaMA-2's optimizer recipe (Touvron et al. 2023, section 2.2): AdamW with beta2 0.95,
# weight decay 0.1, cosine decay. A preset brings it; without one, Megatron's defaults hold.
LLAMA2_RECIPE = {"adam_beta2": 0.95, "weight_decay": 0.1, "lr_decay_style": "cosine"}


@dataclass(frozen=True)
class ModelPreset(ModelConfig):
    """A named model configuration, with what the paper says of it and the training
    defaults that make it useful out of the box."""

    paper_size_billions: float | None = None
    # Training defaults that make the preset useful out of the box (CPU presets only).
    training: dict = field(default_factory=dict)


def _paper(name: str, size: float, layers: int, hidden: int, ffn: int, heads: int, kv: int) -> ModelPreset:
    return ModelPreset(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=kv,
        seq_length=1024,
        vocab_size=32000,
        paper_size_billions=size,
        training={"micro_batch_size": 2, "global_batch_size": 16, **LLAMA2_RECIPE},
    )


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=352,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=128,
        vocab_size=None,
        training={
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "train_iters": 200,
            "lr": 2e-3,
            "min_lr": 2e-4,
            "lr_warmup_iters": 10,
            "log_interval": 10,
            **LLAMA2_RECIPE,
        },
    ),
    "small": ModelPreset(
        name="small",
        num_layers=8,
        hidden_size=512,
        ffn_hidden_size=1376,
        num_attention_heads=8,
        num_query_groups=4,
        seq_length=256,
        vocab_size=None,
        training={
            "micro_batch_size": 4,
            "global_batch_size": 16,
            "train_iters": 300,
            "lr": 6e-4,
            "min_lr": 6e-5,
            "lr_warmup_iters": 30,
            "log_interval": 10,
            **LLAMA2_RECIPE,
        },
    ),
    "10b": _paper("10b", 10, 48, 4096, 10880, 32, 2),
    "19b": _paper("19b", 19, 48, 5632, 14976, 44, 4),
    "30b": _paper("30b", 30, 96, 5120, 13632, 40, 4),
    "40b": _paper("40b", 40, 96, 5888, 15680, 64, 4),
    "52b": _paper("52b", 52, 96, 6656, 17728, 64, 8),
    "69b": _paper("69b", 69, 96, 7680, 20480, 64, 8),
    "88b": _paper("88b", 88, 192, 6144, 16384, 48, 16),
    "110b": _paper("110b", 110, 192, 6912, 18432, 48, 16),
}


def get_preset(name: str) -> ModelPreset:
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[key]
