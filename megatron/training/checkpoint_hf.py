"""Hugging Face LLaMA <-> megatron-core GPTModel: names, fused layouts and configuration.

Where conversions go wrong, and what this does about it:
- Fused QKV: megatron-core keeps one `linear_qkv` weight laid out per query group: the
  group's query heads, then its key head, then its value head ([ng * (np/ng + 2) * d, h]);
  Hugging Face keeps q_proj [np * d, h], k_proj and v_proj [ng * d, h].
- Fused SwiGLU: `linear_fc1` is [gate; up] stacked on the output dimension
  (megatron-core's gated linear unit takes the first half through SiLU).
- RoPE: both use the rotate-half convention (Hugging Face's LLaMA weights were permuted
  from Meta's interleaved layout at publication; megatron-core's default is
  rotary_interleaved=False), so q and k rows are copied unpermuted.
- Untied embeddings (LLaMA-2): a tied Hugging Face model gets its embedding copied into
  the output layer.
- Head width: `head_dim` (when not hidden / heads) is Megatron's kv_channels, and sizes
  q_proj, k_proj, v_proj and o_proj.
- RoPE base: transformers < 5 writes `rope_theta`, >= 5 `rope_parameters.rope_theta`; a
  scaled rotation (Llama 3.1's "llama3", "linear", ...) in either place is refused.
"""

from __future__ import annotations

import json
import math

import torch

from megatron.models.llama import LlamaConfig

# Values this project's model fixes; another value is refused.
FIXED = {"hidden_act": "silu"}
# RoPE types that rotate by the plain base frequencies, as megatron-core's RotaryEmbedding
# does (transformers >= 5 writes "default" in rope_parameters; older ones rope_scaling null).
UNSCALED_ROPE = (None, "default")


class ConversionError(ValueError):
    """An input this conversion cannot represent faithfully."""


def read_hf_config(path: str) -> dict:
    """A Hugging Face JSON file (config.json, the safetensors index) as a dict;
    ConversionError (one line naming the file and what is wrong) when it cannot be read, is
    not UTF-8 JSON or is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ConversionError(f"{path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: not a JSON config (byte {exc.start} is not "
                              "UTF-8)") from None
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not a JSON config (line {exc.lineno} column "
                              f"{exc.colno}: {exc.msg})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object of model settings, found "
                              f"a {type(config).__name__}")
    return config


def _rope_theta(hf: dict) -> int:
    """The RoPE base of a Hugging Face config: `rope_theta` (transformers < 5) or
    `rope_parameters.rope_theta` (>= 5); refused when the rotation is scaled (Llama 3.1's
    "llama3", "linear", "yarn", ...: this model's RoPE, like Megatron's default, is not) or
    the base is not a whole number (Megatron's --rotary-base is an integer)."""
    parameters = hf.get("rope_parameters") or {}
    for key, value in (("rope_scaling", hf.get("rope_scaling")),
                       ("rope_parameters", parameters)):
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if kind not in UNSCALED_ROPE:
                raise ConversionError(f"config.json {key} rope_type {kind!r}: not supported "
                                      "(this model's RoPE is unscaled)")
        elif value:
            raise ConversionError(f"config.json {key} {value!r}: not supported")
    theta = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or \
            not math.isfinite(theta) or theta <= 0 or theta != int(theta):
        raise ConversionError(f"config.json rope_theta {theta!r}: expected a positive whole "
                              "number (Megatron's --rotary-base is an integer)")
    return int(theta)


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> LlamaConfig:
    """This project's model configuration from a Hugging Face LLaMA config.json."""
    if hf.get("model_type") != "llama":
        raise ConversionError(f"config.json model_type {hf.get('model_type')!r}: expected 'llama'")
    for key, value in FIXED.items():
        found = hf.get(key, value)
        if found != value:
            raise ConversionError(f"config.json {key} {found!r}: expected {value!r} (the "
                                  "only value this model supports)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConversionError(f"config.json {key} {hf[key]!r}: not supported")
    rope_base = _rope_theta(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return LlamaConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
        seq_length=seq_length or hf.get("max_position_embeddings", 4096),
        kv_channels=None if head_dim == hf["hidden_size"] // heads else head_dim,
        rope_base=rope_base, norm_epsilon=hf.get("rms_norm_eps", 1e-6),
    )


def hf_config_from_model(cfg: LlamaConfig) -> dict:
    """A Hugging Face LLaMA config.json for this project's model; ConversionError where
    transformers' LLaMA cannot be that model: RoPE over part of each head (it rotates every
    channel), a hidden size that is not a multiple of the heads (its config refuses one,
    head_dim or not)."""
    if cfg.rotary_percent != 1.0:
        raise ConversionError(f"the checkpoint's rotary_percent {cfg.rotary_percent}: a "
                              "Hugging Face LLaMA rotates every channel of a head (expected 1.0)")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConversionError(f"the checkpoint's hidden_size {cfg.hidden_size}: a Hugging Face "
                              "LLaMA config expects a multiple of num_attention_heads "
                              f"{cfg.num_attention_heads}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.norm_epsilon, "rope_theta": float(cfg.rope_base),
        "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def fuse_qkv(cfg: LlamaConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    d, ng, h = cfg.head_dim, cfg.num_query_groups, cfg.hidden_size
    per_group = cfg.num_attention_heads // ng
    return torch.cat([q.reshape(ng, per_group * d, h), k.reshape(ng, d, h),
                      v.reshape(ng, d, h)], dim=1).reshape(-1, h)


def split_qkv(cfg: LlamaConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, ng, h = cfg.head_dim, cfg.num_query_groups, cfg.hidden_size
    per_group = cfg.num_attention_heads // ng
    grouped = qkv.reshape(ng, (per_group + 2) * d, h)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


_LAYER_NAMES = {  # one-to-one per layer: Hugging Face -> GPTModel
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


# What config.json says each Hugging Face tensor's shape is: (its keys, the shape from
# them), by the name's ending (the layers' names end the same way in every layer)
_HF_SHAPES = {
    "embed_tokens.weight": (("vocab_size", "hidden_size"), lambda c: (c.vocab_size, c.hidden_size)),
    "lm_head.weight": (("vocab_size", "hidden_size"), lambda c: (c.vocab_size, c.hidden_size)),
    "norm.weight": (("hidden_size",), lambda c: (c.hidden_size,)),
    "layernorm.weight": (("hidden_size",), lambda c: (c.hidden_size,)),
    "q_proj.weight": (("num_attention_heads", "head_dim", "hidden_size"),
                      lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size)),
    "k_proj.weight": (("num_key_value_heads", "head_dim", "hidden_size"),
                      lambda c: (c.num_query_groups * c.head_dim, c.hidden_size)),
    "o_proj.weight": (("hidden_size", "num_attention_heads", "head_dim"),
                      lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim)),
    "gate_proj.weight": (("intermediate_size", "hidden_size"),
                         lambda c: (c.ffn_hidden_size, c.hidden_size)),
    "down_proj.weight": (("hidden_size", "intermediate_size"),
                         lambda c: (c.hidden_size, c.ffn_hidden_size)),
}
_HF_SHAPES["v_proj.weight"] = _HF_SHAPES["k_proj.weight"]
_HF_SHAPES["up_proj.weight"] = _HF_SHAPES["gate_proj.weight"]
_CONFIG_VALUES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
                  "num_key_value_heads": "num_query_groups",
                  "num_attention_heads": "num_attention_heads",
                  "intermediate_size": "ffn_hidden_size", "head_dim": "head_dim"}
# Buffers some exports carry beside the weights (recomputed by every model): not converted
_DERIVED = ("rotary_emb.inv_freq",)


def check_hf_shape(cfg: LlamaConfig, name: str, tensor: torch.Tensor) -> None:
    """ConversionError when `tensor`'s shape is not the one config.json gives `name`."""
    for ending, (keys, shape_of) in _HF_SHAPES.items():
        if name.endswith(ending):
            expected = shape_of(cfg)
            if tuple(tensor.shape) != expected:
                said = ", ".join(f"{k} {getattr(cfg, _CONFIG_VALUES[k])}" for k in keys)
                raise ConversionError(
                    f"config.json disagrees with the weights: {name} has shape "
                    f"{list(tensor.shape)}, config.json ({said}) gives {list(expected)}")
            return


def hf_to_gpt(cfg: LlamaConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face LlamaForCausalLM state -> GPTModel state (fp32), every tensor checked
    against the shape config.json gives it, none left over."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"the safetensors hold no tensor {name!r}")
        check_hf_shape(cfg, name, hf[name])
        used.add(name)
        return hf[name].float()

    out = {}
    for hf_name, name in _TOP_NAMES.items():
        if hf_name == "lm_head.weight" and hf_name not in hf:  # tied embeddings
            hf_name = "model.embed_tokens.weight"
        out[name] = take(hf_name).clone()
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, name in _LAYER_NAMES.items():
            out[dst + name] = take(src + hf_name).clone()
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            cfg, *(take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"))
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")])
    left = sorted(k for k in set(hf) - used if not k.endswith(_DERIVED))
    if left:
        raise ConversionError(f"config.json disagrees with the weights: the safetensors hold "
                              f"{left[0]!r} (and {len(left) - 1} more) beyond config.json's "
                              f"num_hidden_layers {cfg.num_layers}" if ".layers." in left[0]
                              else f"the safetensors hold {left[0]!r}, which a LLaMA model "
                              "does not have")
    return out


def gpt_to_hf(cfg: LlamaConfig, gpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPTModel state -> Hugging Face LlamaForCausalLM state (contiguous copies)."""
    def take(name: str) -> torch.Tensor:
        if name not in gpt:
            raise ConversionError(f"the checkpoint holds no tensor {name!r}")
        return gpt[name]

    out = {hf_name: take(name) for hf_name, name in _TOP_NAMES.items()}
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for hf_name, name in _LAYER_NAMES.items():
            out[dst + hf_name] = take(src + name)
        q, k, v = split_qkv(cfg, take(src + "self_attention.linear_qkv.weight"))
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        gate, up = take(src + "mlp.linear_fc1.weight").chunk(2)
        out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
    return {k: v.contiguous().clone() for k, v in out.items()}
