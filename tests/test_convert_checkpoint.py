"""Hugging Face LLaMA in and out, against transformers itself: a random GQA model (2 KV
groups, 2 layers) gives the same logits here, comes back with identical tensors, and
fine-tunes here into a model transformers loads and scores like this project."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import types

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megatron.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.checkpoint_hf import (  # noqa: E402
    ConversionError,
    gpt_to_hf,
    hf_config_from_model,
    hf_to_gpt,
    model_config_from_hf,
)
from megatron.training.checkpoint_state import MASTER, checkpoint_name  # noqa: E402
from megatron.training.checkpointing import (  # noqa: E402
    iteration_dir,
    latest_iteration,
    read_all_tensors,
)
from megatron.training.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from megatron.training.training import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 4096  # the demo corpus tokenizer's, so the fine-tuning run can use it
SEQ = 32
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
               "--num-attention-heads", "4", "--group-query-attention",
               "--num-query-groups", "2", "--seq-length",
               str(SEQ), "--vocab-size", str(VOCAB)]


def _load_tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL_MAIN = _load_tool().main


def convert(*argv):
    """The tool's main() in this process: its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = TOOL_MAIN(list(argv))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    directory = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="1MB")
    assert os.path.exists(directory / "model.safetensors.index.json")  # sharded input
    return model, directory


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "ckpt"
    r = convert("--from", "hf", "--to", "megatron", "--input", str(hf_model[1]),
                "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MiB/s" in r.stdout
    return out


@pytest.fixture(scope="module")
def dist_group():
    yield initialize_distributed()
    shutdown_distributed()


def our_model(checkpoint_dir) -> LlamaModel:
    """This project's model with the checkpoint's masters."""
    root = str(checkpoint_dir)
    tensors = read_all_tensors(iteration_dir(root, latest_iteration(root)), MASTER)
    cfg = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                      num_query_groups=2, vocab_size=VOCAB, seq_length=SEQ)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[MASTER + checkpoint_name(cfg, name)])
    return model


def our_logits(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    batch = {"tokens": tokens}
    hidden = None
    for piece in model.pieces[:-1]:
        hidden = piece(hidden, batch)
    head = model.pieces[-1]
    logits, _ = head.output_layer(head.final_layernorm(hidden))  # [s, b, V]
    return logits.transpose(0, 1)


def tokens(seed=1, batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_converted_model_gives_transformers_logits(hf_model, converted, dist_group):
    model, _ = hf_model
    x = tokens()
    with torch.no_grad():
        want = model(x).logits
        got = our_logits(our_model(converted), x)
    assert (got - want).abs().max() < 1e-4


def test_export_back_loads_in_transformers_with_identical_tensors(hf_model, converted, tmp_path):
    out = tmp_path / "back"
    r = convert("--from", "megatron", "--to", "hf", "--input", str(converted), "--output",
                str(out), "--max-shard-size", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    files = set(json.load(open(out / "model.safetensors.index.json"))["weight_map"].values())
    assert len(files) > 1 and r.stdout.count("MiB/s") == len(files)  # a line per shard
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    want = hf_model[0].state_dict()
    got = back.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("argv,fragment", [
    (["--from", "hf", "--to", "megatron", "--input", "/nonexistent"], "no config.json"),
    (["--from", "megatron", "--to", "hf", "--input", "/nonexistent"],
     "no latest_checkpointed_iteration.txt"),
])
def test_bad_input_exits_2_in_one_line(argv, fragment, tmp_path):
    r = convert(*argv, "--output", str(tmp_path / "out"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and fragment in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,fragment", [
    (bytes(range(128, 256)), "not a Hugging Face tokenizer JSON (not UTF-8 text)"),
    (b'{"a": 0, "<|endoftext|>": 1}', "not a Hugging Face tokenizer JSON ("),  # a vocab.json
    ("big", f"{VOCAB + 1} tokens, but the model has {VOCAB} embedding rows"),
])
def test_a_tokenizer_to_ship_that_is_not_one_is_one_line(converted, tmp_path, content,
                                                         fragment):
    """--tokenizer was copied unread: a binary was a UnicodeDecodeError traceback, a
    vocab.json or a larger vocabulary an output directory transformers cannot use."""
    tokenizer = tmp_path / "tokenizer.json"
    if content == "big":
        from tokenizers import Tokenizer, models
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB + 1)}, unk_token="t0"))
        tok.save(str(tokenizer))
    else:
        tokenizer.write_bytes(content)
    r = convert("--from", "megatron", "--to", "hf", "--input", str(converted),
                "--output", str(tmp_path / "out"), "--tokenizer", str(tokenizer))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--tokenizer {tokenizer}: " in lines[0], lines
    assert fragment in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.multiproc  # builds the demo corpus
def test_finetuned_here_then_exported_scores_the_same_in_transformers(
        converted, tmp_path, dist_group, demo_cache):
    trained = tmp_path / "trained"
    run = parse_args([
        *MODEL_FLAGS, "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--load", str(converted), "--finetune",
        "--save", str(trained),
        "--data-cache-dir", demo_cache])
    records = train(run, dist_group)  # here: no process to start
    assert [r["iteration"] for r in records] == [1, 2] and latest_iteration(str(trained)) == 2
    exported = tmp_path / "hf"
    r = convert("--from", "megatron", "--to", "hf", "--input", str(trained), "--output",
                str(exported))
    assert r.returncode == 0, r.stderr[-3000:]
    model = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)  # the run's, shipped
    assert len(tokenizer) == VOCAB and tokenizer.decode(tokenizer("a checkpoint")["input_ids"]) \
        == "a checkpoint"
    ours = our_model(trained)
    x, labels = tokens(seed=2), tokens(seed=3)
    batch = {"tokens": x, "labels": labels, "loss_mask": torch.ones(2, SEQ)}
    with torch.no_grad():
        want = F.cross_entropy(model(x).logits.reshape(-1, VOCAB), labels.reshape(-1))
        got = ours(batch)
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    # Training moved the weights: the comparison is not the converted model's.
    start = our_model(converted)
    with torch.no_grad():
        assert abs(float(start(batch)) - float(got)) > 1e-4


HF_SIZES = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change,fragment", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling rope_type 'linear'"),
    # transformers >= 5 writes Llama 3.1's scaling and base under rope_parameters
    ({"rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}},
     "rope_parameters rope_type 'llama3'"),
    ({"rope_theta": 10000.5}, "rope_theta 10000.5: expected a positive whole number"),
    ({"rope_theta": float("inf")}, "rope_theta inf: expected a positive whole number"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
])
def test_configurations_this_model_cannot_represent_are_refused(change, fragment):
    with pytest.raises(ConversionError, match=fragment.replace("(", r"\(")):
        model_config_from_hf({**HF_SIZES, **change})


@pytest.mark.parametrize("change,expected", [
    ({"rope_theta": 500000.0, "rms_norm_eps": 1e-6}, (500000, 1e-6, None)),  # transformers < 5
    ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, (500000, 1e-6, None)),
    ({"rope_scaling": None, "rms_norm_eps": 1e-5, "head_dim": 24}, (10000, 1e-5, 24)),
    ({"head_dim": 16}, (10000, 1e-6, None)),  # hidden / heads: Megatron's default
])
def test_rope_base_norm_epsilon_and_head_width_come_from_config_json(change, expected):
    """Where each transformers version writes them; an absent rms_norm_eps is
    transformers' default (1e-6)."""
    cfg = model_config_from_hf({**HF_SIZES, **change})
    assert (cfg.rope_base, cfg.norm_epsilon, cfg.kv_channels) == expected


@pytest.mark.parametrize("change,fragment", [
    ({"rotary_percent": 0.5}, "rotary_percent 0.5: a Hugging Face LLaMA rotates every channel"),
    ({"hidden_size": 100, "num_attention_heads": 3, "kv_channels": 32},
     "hidden_size 100: a Hugging Face LLaMA config expects a multiple of num_attention_heads 3"),
])
def test_a_model_transformers_llama_cannot_be_is_refused_on_export(change, fragment):
    """What this project trains (--rotary-percent, --kv-channels beside a hidden size the
    heads do not divide) and no LlamaForCausalLM config can say."""
    cfg = LlamaConfig(**{"num_layers": 1, "hidden_size": 64, "ffn_hidden_size": 160,
                         "num_attention_heads": 4, "num_query_groups": 1, "vocab_size": 256,
                         "seq_length": 8, **change})
    with pytest.raises(ConversionError, match=fragment):
        hf_config_from_model(cfg)


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 1, 24), (4, 2, 24), (6, 2, 16),
                                                    (6, 6, 16)])
def test_grouped_query_layouts_and_head_widths_give_transformers_logits(
        heads, groups, head_dim, dist_group):
    """q/k/v fused per query group (multi-query, grouped, full) and heads whose width is not
    hidden / heads (Megatron's --kv-channels): transformers' model converted here gives its
    logits, and converts back to its own tensors bit for bit."""
    torch.manual_seed(heads * 10 + groups)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64 if heads == 4 else 96, intermediate_size=100,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=groups,
        head_dim=head_dim, max_position_embeddings=7, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    cfg = model_config_from_hf(config.to_dict())
    hf = model.state_dict()
    gpt = hf_to_gpt(cfg, hf)
    ours = LlamaModel(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(gpt[checkpoint_name(cfg, name)])
        x = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
        assert (our_logits(ours, x) - model(x).logits).abs().max() < 1e-4
    back = gpt_to_hf(cfg, gpt)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert hf_config_from_model(cfg)["head_dim"] == head_dim


def test_llama3_shape_round_trips_through_the_tool(tmp_path, dist_group):
    """A model saved by this transformers with what LLaMA-2's defaults are not: rope_theta
    500000, rms_norm_eps 1e-6, head_dim 24 of hidden 64, 1 KV group, a vocabulary of 300
    (not a multiple of 128): the tool prints the flags that build it, the checkpoint gives
    transformers' logits here and in megatron-core's GPTModel read by megatron-core's
    dist_checkpointing, and the export is the same model."""
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=9,
        rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    r = convert("--from", "hf", "--to", "megatron", "--input", str(tmp_path / "hf"),
                "--output", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].endswith(
        "--vocab-size 300 --seq-length 9 --kv-channels 24 --rotary-base 500000 "
        "--norm-epsilon 1e-06 --make-vocab-size-divisible-by 1")
    run = parse_args([*r.stdout.split("--finetune ")[1].split(), "--micro-batch-size", "1"])
    cfg = LlamaConfig.from_model(run.model, run.model.padded_vocab_size(300), seed=1)
    root = str(tmp_path / "ckpt")
    tensors = read_all_tensors(iteration_dir(root, latest_iteration(root)), MASTER)
    ours = LlamaModel(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(tensors[MASTER + checkpoint_name(cfg, name)])
        x = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
        want = model(x).logits
        assert (our_logits(ours, x) - want).abs().max() < 1e-4
    # megatron-core's own reader fills its GPTModel of this shape from the torch_dist files
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel

    from megatron.models.llama import layer_spec, transformer_config

    gpt = GPTModel(config=transformer_config(cfg), transformer_layer_spec=layer_spec(),
                   vocab_size=300, max_sequence_length=9, position_embedding_type="rope",
                   rotary_base=500000, share_embeddings_and_output_weights=False).eval()
    gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(),
                                                iteration_dir(root, 0)), strict=False)
    mask = torch.triu(torch.ones(1, 1, 9, 9, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        assert (gpt(x, torch.arange(9).expand(2, 9), mask) - want).abs().max() < 1e-4
    r = convert("--from", "megatron", "--to", "hf", "--input", root, "--output",
                str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    want, got = model.state_dict(), back.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert back.config.rope_parameters["rope_theta"] == 500000.0


def test_a_megatron_core_gpt_model_loads_the_checkpoint_directly(hf_model, converted,
                                                                dist_group):
    """The `model.` tensors are GPTModel's own state dict: no mapping on the reader's side."""
    from megatron.core.models.gpt import GPTModel

    from megatron.models.llama import layer_spec, transformer_config

    cfg = our_model(converted).cfg
    gpt = GPTModel(config=transformer_config(cfg), transformer_layer_spec=layer_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False).eval()
    root = str(converted)
    state = {k.removeprefix(MASTER): v for k, v in
             read_all_tensors(iteration_dir(root, latest_iteration(root)), MASTER).items()}
    result = gpt.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all("_extra_state" in k for k in result.missing_keys)
    x = tokens(seed=4)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        got = gpt(x, torch.arange(SEQ).expand(2, SEQ), mask)
        want = hf_model[0](x).logits
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("name,content,fragment", [
    ("config.json", b'{"model_type": "llama",', "config.json: not a JSON config (line 1"),
    ("model.safetensors.index.json", b'{"metadata": {}}', "expected a \"weight_map\""),
])
def test_a_broken_hf_json_file_is_one_line_naming_it(tmp_path, name, content, fragment):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / name).write_bytes(content)
    result = convert("--from", "hf", "--to", "megatron", "--input", str(model),
                     "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "out").exists()


def _edited_copy(hf_model, tmp_path, config_changes=None):
    """A copy of the Hugging Face model directory, its config.json changed."""
    model = tmp_path / "hf"
    shutil.copytree(hf_model[1], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    return model


@pytest.mark.parametrize("case,expected", [
    ("truncated", "is not a complete safetensors file (incomplete metadata, file not fully "
                  "covered); expected the file as saved (truncated by a copy or download?)"),
    ("hidden_size", "config.json disagrees with the weights: model.embed_tokens.weight has "
                    "shape [4096, 64], config.json (vocab_size 4096, hidden_size 96) gives "
                    "[4096, 96]"),
    ("num_hidden_layers", "config.json disagrees with the weights: the safetensors hold "
                          "'model.layers.1.input_layernorm.weight' (and 8 more) beyond "
                          "config.json's num_hidden_layers 1"),
])
def test_weights_that_are_cut_short_or_disagree_with_the_config_are_one_line(
        hf_model, tmp_path, case, expected):
    """A safetensors shard cut in half (a copy that stopped), a config.json whose sizes are
    not the weights': exit 2, one line, nothing written."""
    if case == "truncated":
        model = _edited_copy(hf_model, tmp_path)
        shard = sorted(model.glob("*.safetensors"))[0]
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        # (head_dim, which newer exports write, changed with the hidden size)
        model = _edited_copy(hf_model, tmp_path, {"hidden_size": 96, "head_dim": 24}
                             if case == "hidden_size" else {case: 1})
    result = convert("--from", "hf", "--to", "megatron", "--input", str(model),
                     "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(expected), lines
    if case == "truncated":
        assert lines[0].startswith(f"convert_checkpoint.py: error: --input {model}: "
                                   f"{shard.name} ")
    assert not (tmp_path / "out").exists()
