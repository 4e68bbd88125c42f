"""Convert LLaMA checkpoints between Hugging Face's layout and this project's.

    python tools/convert_checkpoint.py --from hf --to megatron --input HF_DIR --output CKPT_DIR
    python tools/convert_checkpoint.py --from megatron --to hf --input CKPT_DIR --output HF_DIR

hf -> megatron reads config.json and the safetensors (one file or sharded with
model.safetensors.index.json) and writes a weights-only checkpoint at iteration 0: start
training from it with `pretrain_llama.py --load CKPT_DIR --finetune` and the model's flags.
megatron -> hf writes the latest iteration's fp32 masters as config.json plus safetensors
(sharded above --max-shard-size) and the tokenizer (--tokenizer, or the one the run
trained with, which every checkpoint carries). Outputs appear complete or not at all; a line per shard reports its
size and speed. Exit status 2 on bad input, with one line naming what was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron.common.files import missing_file, staged_paths  # noqa: E402
from megatron.config.model import ARCHITECTURE_DEFAULTS  # noqa: E402
from megatron.models.llama import LlamaConfig  # noqa: E402
from megatron.training.checkpoint_format import (  # noqa: E402
    foreign_architecture,
    saved_args,
    verify_checkpoint,
)
from megatron.training.checkpoint_hf import (  # noqa: E402
    ConversionError,
    gpt_to_hf,
    hf_config_from_model,
    hf_to_gpt,
    model_config_from_hf,
    read_hf_config,
)
from megatron.training.checkpoint_state import MASTER, OwnedState  # noqa: E402
from megatron.training.checkpointing import (  # noqa: E402
    CheckpointError,
    CheckpointSaver,
    find_checkpoint,
    read_all_tensors,
    read_common,
)
from megatron.training.distributed import (  # noqa: E402
    initialize_distributed,
    shutdown_distributed,
)

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _progress(verb: str, path: str, nbytes: int, seconds: float) -> None:
    print(f"{verb} {path}: {nbytes / MiB:.1f} MiB in {seconds:.2f} s "
          f"({nbytes / MiB / max(seconds, 1e-9):.1f} MiB/s)", flush=True)


def _check_empty_output(path: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"--output {path}: exists and is not empty; expected a new "
                              "directory (nothing is overwritten)")


def _check_free_disk(path: str, nbytes: int) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(parent).free
    if nbytes > free:
        raise ConversionError(f"--output {path}: needs {nbytes / MiB:.1f} MiB, "
                              f"{free / MiB:.1f} MiB free")


def read_hf(directory: str) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ConversionError(f"--input {directory}: no config.json; expected a Hugging Face "
                              "model directory")
    config = read_hf_config(config_path)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_hf_config(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index}: expected a \"weight_map\" object naming each "
                                  "tensor's file")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"--input {directory}: no model.safetensors or "
                              "model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(directory, name)
        t0 = time.perf_counter()
        try:
            shard = load_file(path)
        except SafetensorError as exc:  # cut short (a copy or download that stopped), or
            # not safetensors at all: the library says which part of the header is wrong
            why = str(exc).removeprefix("Error while deserializing header: ")
            raise ConversionError(f"--input {directory}: {name} is not a complete "
                                  f"safetensors file ({why}); expected the file as saved "
                                  "(truncated by a copy or download?)") from None
        _progress("read", path, sum(t.nbytes for t in shard.values()), time.perf_counter() - t0)
        tensors.update(shard)
    return config, tensors


def hf_to_megatron(args: argparse.Namespace) -> None:
    _check_empty_output(args.output)
    config, hf = read_hf(args.input)
    cfg = model_config_from_hf(config)
    gpt = hf_to_gpt(cfg, hf)
    model_args = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "ffn_hidden_size": cfg.ffn_hidden_size,
                  "num_attention_heads": cfg.num_attention_heads,
                  "num_query_groups": cfg.num_query_groups, "vocab_size": cfg.vocab_size,
                  "seq_length": cfg.seq_length, **architecture_flags(cfg)}
    created = not os.path.exists(args.output)
    try:
        saver = CheckpointSaver(args.output, cfg, async_save=False)
        saver.save(0, OwnedState({MASTER + k: v for k, v in gpt.items()}, 0, None),
                   {"args": model_args, "hf_config": config, "consumed_samples": 0,
                    "padded_vocab_size": cfg.vocab_size})
        saver.close()
    except BaseException:
        if created:
            shutil.rmtree(args.output, ignore_errors=True)
        raise
    # Megatron's meaning: a group count takes effect with --group-query-attention only
    flags = " ".join(("--group-query-attention " if k == "num_query_groups"
                      and v != cfg.num_attention_heads else "") + f"--{k.replace('_', '-')} {v}"
                     for k, v in model_args.items())
    print(f"wrote {args.output}; train from it with: pretrain_llama.py --load {args.output} "
          f"--finetune {flags}")


def architecture_flags(cfg: LlamaConfig) -> dict:
    """The flags beyond the sizes whose Megatron default would build another model than
    `cfg`: the head width, RoPE base, norm epsilon, and a vocabulary that the default
    padding (a multiple of 128) would grow beyond the converted rows."""
    values = {"kv_channels": cfg.kv_channels, "rotary_base": cfg.rope_base,
              "norm_epsilon": cfg.norm_epsilon,
              "make_vocab_size_divisible_by": ARCHITECTURE_DEFAULTS[
                  "make_vocab_size_divisible_by"]}
    if cfg.vocab_size % values["make_vocab_size_divisible_by"]:
        values["make_vocab_size_divisible_by"] = 1
    return {k: v for k, v in values.items() if v != ARCHITECTURE_DEFAULTS[k]}


def _model_config(common: dict, tensors: dict[str, torch.Tensor]) -> LlamaConfig:
    a = saved_args(common)
    foreign = foreign_architecture(a)
    if foreign:
        raise ConversionError(f"the checkpoint was saved with {foreign}: not a model this "
                              "conversion writes faithfully")
    try:
        return LlamaConfig(
            num_layers=a["num_layers"], hidden_size=a["hidden_size"],
            ffn_hidden_size=a["ffn_hidden_size"], num_attention_heads=a["num_attention_heads"],
            num_query_groups=a["num_query_groups"] or a["num_attention_heads"],
            vocab_size=tensors["embedding.word_embeddings.weight"].shape[0],
            seq_length=a["seq_length"], kv_channels=a.get("kv_channels"),
            rope_base=float(a.get("rotary_base") or 10000),
            rotary_percent=a.get("rotary_percent") or 1.0,
            norm_epsilon=a.get("norm_epsilon") or 1e-5)
    except KeyError as exc:
        # ours and Megatron-LM <= 0.18 keep it in common.pt, 0.19 in its `common_state`
        raise ConversionError(f"the checkpoint's common state (its args) names no "
                              f"{exc.args[0]}") from None


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def _read_tokenizer(path: str, vocab_rows: int) -> str:
    """--tokenizer's text once it is a tokenizer JSON this model can ship: a file copied
    unread would make an output directory that transformers cannot load."""
    if not os.path.isfile(path):
        raise ConversionError(f"--tokenizer {path}: {missing_file(path)}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        from tokenizers import Tokenizer

        size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    except OSError as err:
        raise ConversionError(f"--tokenizer {path}: unreadable ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ConversionError(f"--tokenizer {path}: not a Hugging Face tokenizer JSON (not "
                              "UTF-8 text); expected tokenizer.json as tokenizers saves it"
                              ) from None
    except Exception as err:  # not UTF-8, not JSON, not a tokenizer: tokenizers says which
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConversionError(f"--tokenizer {path}: not a Hugging Face tokenizer JSON "
                              f"({first}); expected tokenizer.json as tokenizers saves it"
                              ) from None
    if size > vocab_rows:
        raise ConversionError(f"--tokenizer {path}: {size} tokens, but the model has "
                              f"{vocab_rows} embedding rows; expected the tokenizer the run "
                              "trained with (or one no larger)")
    return text


def megatron_to_hf(args: argparse.Namespace) -> None:
    _check_empty_output(args.output)
    found = find_checkpoint(args.input)
    if found is None:
        raise ConversionError(f"--input {args.input}: no latest_checkpointed_iteration.txt; "
                              "expected a checkpoint directory")
    directory, note = found
    if note:
        print(note)
    verify_checkpoint(directory)
    common = read_common(directory)
    iteration = common.get("iteration", 0)
    gpt = {k.removeprefix(MASTER): v for k, v in read_all_tensors(directory, MASTER).items()}
    cfg = _model_config(common, gpt)
    dtype = DTYPES[args.dtype]
    hf = {k: v.to(dtype) for k, v in gpt_to_hf(cfg, gpt).items()}
    tokenizer_json = common.get("tokenizer_json")  # what the run trained with
    if args.tokenizer:
        tokenizer_json = _read_tokenizer(args.tokenizer, cfg.vocab_size)
    _check_free_disk(args.output, sum(t.nbytes for t in hf.values()))
    shards = _shards(hf, args.max_shard_size * MiB)
    config = {**hf_config_from_model(cfg), "torch_dtype": str(dtype).removeprefix("torch.")}
    with staged_paths(args.output, directories=True) as (staging,):
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(len(shards))])
        for name, shard in zip(names, shards):
            t0 = time.perf_counter()
            save_file(shard, os.path.join(staging, name), metadata={"format": "pt"})
            _progress("wrote", os.path.join(args.output, name),
                      sum(t.nbytes for t in shard.values()), time.perf_counter() - t0)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in hf.values())},
                     "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
            with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        if tokenizer_json:
            with open(os.path.join(staging, "tokenizer.json"), "w") as f:
                f.write(tokenizer_json)
            with open(os.path.join(staging, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    print(f"wrote {args.output} (iteration {iteration}, {len(shards)} safetensors file(s))")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", required=True, choices=("hf", "megatron"))
    p.add_argument("--to", dest="target", required=True, choices=("hf", "megatron"))
    p.add_argument("--input", required=True, metavar="DIR")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="megatron -> hf: the dtype of the written weights (default fp32)")
    p.add_argument("--max-shard-size", type=int, default=5000, metavar="MiB",
                   help="megatron -> hf: split the safetensors above this size")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="megatron -> hf: tokenizer JSON to ship (default: the one the "
                        "run trained with)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.source == args.target:
        print(f"convert_checkpoint.py: error: --to {args.target}: expected the other format "
              f"than --from {args.source}", file=sys.stderr)
        return 2
    if args.max_shard_size < 1:
        print(f"convert_checkpoint.py: error: --max-shard-size {args.max_shard_size}: "
              "expected a positive number of MiB", file=sys.stderr)
        return 2
    # megatron-core's sharded layout is built from its modules, which need its process
    # groups: a one-process group unless the caller has one.
    own_group = not torch.distributed.is_initialized()
    try:
        if own_group:
            initialize_distributed()
        (hf_to_megatron if args.source == "hf" else megatron_to_hf)(args)
    except (ConversionError, CheckpointError, OSError, KeyError) as exc:
        print(f"convert_checkpoint.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if own_group:
            shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
