"""megatron-core's `torch_dist` format as this project stores it: the sharded state of a
train step's tensors (GPTModel's sharded keys for the model, megatron-core's optimizer keys
for Adam's moments), the way back from a stored key to ours, Megatron's common-state keys,
and the checksums recorded beside the files. checkpointing.py puts them in directories.
"""

from __future__ import annotations

import json
import os
import pickle
import types
import zlib
from typing import IO, Any

import torch
import torch.distributed as dist

from megatron.models.llama import LlamaConfig
from megatron.training import checkpoint_layout as layout
from megatron.training.checkpoint_state import EXP_AVG, EXP_AVG_SQ, MASTER, STATE_PREFIXES

CHECKSUMS = "checksums.json"  # ours: every other file's size and CRC-32, verified at load
# megatron-core's optimizer-state prefixes (dist_checkpointing.optimizer), ours beside them
OPTIMIZER_KEYS = {EXP_AVG: "optimizer.state.exp_avg", EXP_AVG_SQ: "optimizer.state.exp_avg_sq"}
FP32_MASTER_KEY = "optimizer.state.fp32_param"  # a Megatron mixed-precision run's masters
MiB = 2**20


class CheckpointError(ValueError):
    """A checkpoint or its tracker is missing, unreadable or does not fit this run."""


class _Unresolved:
    """Stands for a class the saving program had and this one lacks (megatron-core 0.19's
    enums in Megatron-LM's args, read with 0.16): keeps what it was built from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__}{self.args or ''}>"


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError):
            return type(f"{module}.{name}", (_Unresolved,), {})


TOLERANT_PICKLE = types.ModuleType("tolerant_pickle")  # a pickle_module for torch.load
TOLERANT_PICKLE.Unpickler = _TolerantUnpickler
TOLERANT_PICKLE.load = lambda f, **kw: _TolerantUnpickler(f, **kw).load()


def load_common_state(source: str | IO[bytes]) -> Any:
    """torch.load of a common state (common.pt, or megatron-core 0.19's `common_state`
    bytes) that another megatron-core version wrote: a class this version lacks (an enum
    among Megatron-LM's args) loads as a stand-in instead of failing the whole load."""
    return torch.load(source, map_location="cpu", weights_only=False,
                      pickle_module=TOLERANT_PICKLE)


def split_key(key: str) -> tuple[str, str]:
    """(our prefix, GPTModel name) of an OwnedState key."""
    for prefix in STATE_PREFIXES:
        if key.startswith(prefix):
            return prefix, key[len(prefix):]
    raise KeyError(key)


def sharded_state(model: LlamaConfig, tensors: dict[str, torch.Tensor],
                  fp32_masters: bool = False) -> dict:
    """megatron-core's sharded state dict of `tensors` (OwnedState keys; `rng_state.*`
    kept whole): the model under GPTModel's sharded keys, the moments under
    megatron-core's optimizer keys, the layers' `_extra_state` objects; factories applied.
    `fp32_masters`: read the masters from a Megatron mixed-precision run's fp32 copy."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import apply_factories

    named = {k: split_key(k) for k in tensors if not k.startswith("rng_state.")}
    entries = layout.layout_of(model, {name for _, name in named.values()})
    out: dict = {name: entry for name, entry in entries.items()
                 if isinstance(entry, ShardedObject)}
    for key, tensor in tensors.items():
        if key not in named:
            out[key] = ShardedTensor.from_rank_offsets(key, tensor)
            continue
        prefix, name = named[key]
        optimizer = OPTIMIZER_KEYS.get(prefix, FP32_MASTER_KEY if fp32_masters else None)
        out[key] = layout.with_data(entries[name], tensor, optimizer)
    apply_factories(out)
    return out


def sharded_tensors(sharded: dict) -> list:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return [v for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


def saved_args(common: dict | None) -> dict:
    """The flags a checkpoint was saved with, whoever wrote it (a dict here in format 1, a
    namespace in Megatron's), with Megatron's implicit query groups made explicit."""
    args = (common or {}).get("args")
    args = dict(vars(args)) if hasattr(args, "__dict__") else dict(args or {})
    if args.get("group_query_attention") is False:
        args["num_query_groups"] = args.get("num_attention_heads")
    return args


def saved_vocab_rows(common: dict | None) -> int | None:
    """The padded vocabulary a checkpoint's embedding and output layer have (ours record
    it beside the args, Megatron-LM's in its args); None when it recorded none."""
    rows = (common or {}).get("padded_vocab_size") or saved_args(common).get("padded_vocab_size")
    return int(rows) if rows else None


# This design's architecture as Megatron-LM's flags: what its --use-checkpoint-args
# (load_args_from_checkpoint) reads to rebuild the model, with the values that name it.
MEGATRON_ARCHITECTURE = {
    "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
    "add_position_embedding": False, "use_rotary_position_embeddings": True,
    "rotary_interleaved": False, "untie_embeddings_and_output_weights": True,
    "add_bias_linear": False, "disable_bias_linear": True, "add_qkv_bias": False,
    "squared_relu": False, "apply_layernorm_1p": False,
    "apply_query_key_layer_scaling": False, "num_experts": None, "mtp_num_layers": None,
    "use_rope_scaling": False, "qk_layernorm": False, "multi_latent_attention": False,
    "spec": None, "ckpt_format": "torch_dist", "use_legacy_models": False,
    "tensor_model_parallel_size": 1, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
}


# The architecture flags that decide what a checkpoint's tensors compute. A model that
# differs here (LLaMA 3.1's scaled RoPE, interleaved RoPE, tied embeddings, biases,
# LayerNorm, ...) has tensors of the same names, or a subset: loaded or exported as this
# design's, it would silently be another model.
COMPUTED_ARCHITECTURE = ("swiglu", "normalization", "position_embedding_type",
                         "rotary_interleaved", "use_rope_scaling",
                         "untie_embeddings_and_output_weights", "add_bias_linear",
                         "add_qkv_bias", "squared_relu", "apply_layernorm_1p", "qk_layernorm",
                         "multi_latent_attention", "num_experts")


def foreign_architecture(saved: dict) -> str:
    """'' when a checkpoint's args (saved_args) describe this design's layers, a flag it did
    not record counting as this design's (ours record none); else the first that does not,
    as "use_rope_scaling True (this model computes False)"."""
    for key in COMPUTED_ARCHITECTURE:
        value, ours = saved.get(key), MEGATRON_ARCHITECTURE[key]
        if value is not None and value != ours:
            return f"{key} {value!r} (this model computes {ours!r})"
    return ""


def megatron_common(common: dict, iteration: int) -> dict:
    """Megatron's common-state keys beside ours: `args` as a namespace (Megatron-LM reads
    it with getattr) with the architecture spelled as its flags, `checkpoint_version`, and
    `opt_param_scheduler` (both schedulers count samples)."""
    flags = saved_args(common)
    global_batch_size = flags.get("global_batch_size") or 1
    heads = flags.get("num_attention_heads")
    args = types.SimpleNamespace(**{
        "max_position_embeddings": flags.get("seq_length"), **flags, **MEGATRON_ARCHITECTURE,
        "kv_channels": flags.get("kv_channels") or (
            flags["hidden_size"] // heads if heads and flags.get("hidden_size") else None),
        "pipeline_model_parallel_size": flags.get("pipeline_model_parallel_size") or 1,
        "padded_vocab_size": common.get("padded_vocab_size", flags.get("vocab_size")),
        "group_query_attention": True,
        "consumed_train_samples": common.get("consumed_samples",
                                             iteration * global_batch_size),
        "consumed_valid_samples": 0})
    out = {**common, "args": args, "checkpoint_version": 3.0,
           "num_floating_point_operations_so_far":
               common.get("num_floating_point_operations_so_far", 0)}
    if "lr_schedule" in common:
        out["opt_param_scheduler"] = common["lr_schedule"]
    return out


def scheduler_units(state: dict, factor: float) -> dict:
    """An OptimizerParamScheduler state with its step counts multiplied by `factor`."""
    return {k: (v * factor if k.endswith("steps") else v) for k, v in state.items()}


def owned_key(stored: str, fp32_masters: bool) -> tuple[str, str] | None:
    """(our prefix, megatron-core key) of a stored tensor; None for what we do not read."""
    for ours, theirs in OPTIMIZER_KEYS.items():
        if stored.startswith(theirs + "."):
            return ours, stored[len(theirs) + 1:]
    if stored.startswith(FP32_MASTER_KEY + "."):
        return MASTER, stored[len(FP32_MASTER_KEY) + 1:]
    if stored.startswith(("optimizer.", "rng_state")) or fp32_masters:
        return None
    return MASTER, stored


def file_checksum(path: str) -> dict:
    """{"bytes": size, "crc32": CRC-32} of a file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as stream:
        while block := stream.read(16 * MiB):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": crc}


def verify_checkpoint(directory: str, process_group: dist.ProcessGroup | None = None) -> None:
    """Every file checksums.json lists has its recorded size and CRC-32 (a checkpoint
    without checksums.json, megatron-core's or an older one of ours, is not checked). With
    a process group each rank reads its share of the files; all raise together, naming
    the first damaged file. Collective when `process_group` is given."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(path):
        return
    try:
        with open(path) as stream:
            recorded = json.load(stream)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    rank, world = ((dist.get_rank(process_group), dist.get_world_size(process_group))
                   if process_group is not None else (0, 1))
    damaged = []
    for name in sorted(recorded)[rank::world]:
        file, want = os.path.join(directory, name), recorded[name]
        if not os.path.exists(file):
            damaged.append(f"{file}: missing; expected {want['bytes']} bytes")
            continue
        got = file_checksum(file)
        if got["bytes"] != want["bytes"]:
            damaged.append(f"{file}: {got['bytes']} bytes, expected {want['bytes']} "
                           "(truncated or damaged)")
        elif got["crc32"] != want["crc32"]:
            damaged.append(f"{file}: damaged (CRC-32 {got['crc32']:08x}, expected "
                           f"{want['crc32']:08x} when saved)")
    if process_group is not None:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, damaged, group=process_group)
        damaged = [line for part in gathered for line in part]
    if damaged:
        raise CheckpointError(damaged[0])
