"""Megatron-LM 0.19's example launch scripts (tests/megatron_lm_examples.py) against
pretrain_llama.py's parser: no unknown flag; what this design cannot do is refused in one
line naming every such flag and what to use instead; the rest is accepted with Megatron's
meaning."""

import pytest

from megatron.config.values import parse_split
from megatron.training.arguments import build_parser, parse_args
from tests.megatron_lm_examples import FP8, SCRIPTS

# What each script asks that this design refuses (the refusal names each).
REFUSED = {
    "examples/llama": ["--apply-layernorm-1p", "--decoupled-lr", "--decoupled-min-lr",
                       "--fp8-format", "--fp8-param-gather"],
    "examples/gpt3": ["--tensor-model-parallel-size", "--step-batch-size-schedule"],
    "examples/megatron_fsdp": ["--apply-layernorm-1p", "--use-megatron-fsdp",
                               "--decoupled-lr", "--fp8-format", "--fp8-param-gather",
                               "--ckpt-format"],
}


def without(argv: list[str], flags: list[str]) -> list[str]:
    """`argv` less `flags` and their values (the next words that are not flags)."""
    out, skipping = [], False
    for word in argv:
        if word.startswith("--"):
            skipping = word in flags
        if not skipping:
            out.append(word)
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_megatron_lm_0_19s_examples_is_known(script):
    _, unknown = build_parser().parse_known_args(SCRIPTS[script])
    assert unknown == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_what_the_design_cannot_do_is_refused_in_one_line_naming_every_flag(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(SCRIPTS[script])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert all(flag in lines[0] for flag in REFUSED[script]), lines[0]
    assert "--use-megatron-fsdp" not in lines[0] or "--zero-stage" in lines[0]


def test_the_llama_example_less_its_refused_flags_is_megatrons_run(tmp_path):
    """FP8 recipe details without --fp8-format are no-ops (as in Megatron); the quoted
    split is Megatron's 99,1,0; the values are honoured."""
    argv = without(SCRIPTS["examples/llama"], REFUSED["examples/llama"])
    assert "--fp8-amax-history-len" in argv  # kept: accepted without --fp8-format
    run = parse_args([w.replace("CACHE", str(tmp_path)) for w in argv])
    assert parse_split(run.data.split) == (99.0, 1.0, 0.0)
    m = run.model
    assert (m.rotary_base, m.kv_channels, m.num_query_groups, m.init_method_std) == \
        (1000000, 16, 2, 0.0134)
    assert run.training.train_iters == 160 // 8  # --train-samples / --global-batch-size
    assert run.precision.dtype == "bf16"


def test_fp8_recipe_details_without_fp8_format_are_accepted():
    parse_args(["--model-preset", "tiny", *without(FP8, ["--fp8-format",
                                                         "--fp8-param-gather"])])


def test_null_tokenizer_has_megatron_0_19s_vocabulary():
    """The LLaMA example's --vocab-size 128256: 128256 ids, the end of document 128255, and
    128256 embedding rows as 0.19 builds (0.16: 128257 ids, padded to 128384)."""
    from megatron.data.run_data import build_run_tokenizer

    run = parse_args(["--model-preset", "tiny", "--mock-data", "--tokenizer-type",
                      "NullTokenizer", "--vocab-size", "128256"])
    tokenizer = build_run_tokenizer(run, None)
    assert (tokenizer.vocab_size, tokenizer.eod) == (128256, 128255)
    assert run.model.padded_vocab_size(tokenizer.vocab_size) == 128256
