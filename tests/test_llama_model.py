"""The piece list is megatron-core's GPTModel, cut at layer boundaries."""

from dataclasses import replace

import pytest
import torch

from megatron.config.model import count_parameters, count_parameters_full_mha
from megatron.config.presets import PRESETS
from megatron.models.llama import (
    LlamaConfig,
    LlamaModel,
    build_piece,
    gpt_model_name,
    layer_spec,
    norm_module,
    run_pieces,
    to_gpt_model_state_dict,
    transformer_config,
)
from megatron.training.distributed import initialize_distributed, shutdown_distributed

CFG = LlamaConfig(num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                  num_query_groups=2, vocab_size=300, seq_length=16, seed=7)


@pytest.fixture(scope="module", autouse=True)
def _dist():
    initialize_distributed()
    yield
    # Later tests fork processes that set up their own groups.
    shutdown_distributed()


def _batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.seq_length
    return {
        "tokens": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
        "labels": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).expand(b, s),
    }


def _gpt_model(cfg, pieces):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # the decoder block with this project's layer spec and its RMSNorm as the final norm
    # (megatron-core's default final norm is torch's own module)
    block = TransformerBlockSubmodules(layer_specs=[layer_spec()] * cfg.num_layers,
                                       layer_norm=norm_module())
    gpt = GPTModel(config=transformer_config(cfg), transformer_layer_spec=block,
                   vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                   position_embedding_type="rope", rotary_percent=cfg.rotary_percent,
                   rotary_base=int(cfg.rope_base), share_embeddings_and_output_weights=False)
    result = gpt.load_state_dict(to_gpt_model_state_dict(cfg, pieces), strict=False)
    assert not result.unexpected_keys
    assert all("_extra_state" in k for k in result.missing_keys)
    return gpt


# Beyond CFG: one query group, heads 24 wide (--kv-channels) of hidden 64, half of each
# head rotated (--rotary-percent), base 500000, eps 1e-6, an odd sequence and FFN width.
OTHER_SHAPE = replace(CFG, num_layers=2, ffn_hidden_size=100, num_query_groups=1,
                      kv_channels=24, rotary_percent=0.5, rope_base=500000.0,
                      norm_epsilon=1e-6, seq_length=7)


@pytest.mark.parametrize("cfg,tolerance", [(CFG, 0.0), (OTHER_SHAPE, 1e-6)],
                         ids=["default", "other-shape"])
def test_pieces_equal_gpt_model_loss_and_grads(cfg, tolerance):
    """Bit for bit at CFG; within 1e-6 at the other shape, where SDPA's math kernel given
    the reference's causal mask and the same kernel told is_causal (the pieces) differ in
    the last bit of a layer's output (3e-9) at head width 24."""
    model = LlamaModel(cfg)
    gpt = _gpt_model(cfg, model.pieces)
    batch = _batch(cfg, b=3)
    s = cfg.seq_length
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    ref = gpt(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"]).mean()
    ours = model(batch)
    torch.testing.assert_close(ours, ref, rtol=0, atol=tolerance)
    ref.backward()
    ours.backward()
    ours_grads = {
        gpt_model_name(cfg, index, name): param.grad
        for index, piece in enumerate(model.pieces)
        for name, param in piece.named_parameters()
    }
    assert ours_grads.keys() == dict(gpt.named_parameters()).keys()
    for name, param in gpt.named_parameters():
        torch.testing.assert_close(ours_grads[name], param.grad, rtol=0, atol=tolerance)


def test_piece_built_alone_has_the_weights_it_has_in_the_full_model():
    model = LlamaModel(CFG)
    for index in (0, 2, CFG.num_layers + 1):
        alone = build_piece(CFG, index)
        for (n1, p1), (n2, p2) in zip(alone.named_parameters(), model.pieces[index].named_parameters()):
            assert n1 == n2
            assert torch.equal(p1, p2), n1


def test_model_cut_anywhere_gives_the_same_loss():
    model = LlamaModel(CFG)
    batch = _batch(CFG, seed=3)
    whole = model(batch)
    for cut in range(1, CFG.num_pieces):
        hidden = run_pieces(model.pieces[:cut], None, batch)
        hidden = hidden.detach().requires_grad_(True)  # what crosses a pipeline boundary
        assert torch.equal(run_pieces(model.pieces[cut:], hidden, batch), whole)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_parameter_count_matches_closed_form(heads, groups):
    cfg = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=heads,
                      num_query_groups=groups, vocab_size=500, seq_length=8)
    built = sum(p.numel() for p in LlamaModel(cfg).parameters())
    closed = count_parameters(2, 64, 160, heads, groups, 500).total
    # 2 norms + attention h*(h + 2*kv) + h*h + SwiGLU 3*h*ffn per layer; 2*V*h; final norm h.
    kv = groups * 64 // heads
    by_hand = 2 * (2 * 64 + 64 * (64 + 2 * kv) + 64 * 64 + 3 * 64 * 160) + 2 * 500 * 64 + 64
    assert built == closed == by_hand


@pytest.mark.parametrize("name", ["10b", "19b", "30b", "40b", "52b", "69b", "88b", "110b"])
def test_paper_presets_match_the_size_column_when_counted_as_full_attention(name):
    p = PRESETS[name]
    mha = count_parameters_full_mha(p.num_layers, p.hidden_size, p.ffn_hidden_size, p.vocab_size)
    assert abs(mha / 1e9 - p.paper_size_billions) / p.paper_size_billions < 0.03
    real = count_parameters(p.num_layers, p.hidden_size, p.ffn_hidden_size,
                            p.num_attention_heads, p.num_query_groups, p.vocab_size).total
    assert real < mha  # grouped-query attention has narrower K/V projections
    assert p.hidden_size % p.num_attention_heads == 0
    assert p.num_attention_heads % p.num_query_groups == 0


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_swiglu_without_grad_is_megatron_cores_bit_for_bit(dtype):
    """The layer's forward without grad (its SwiGLU in place in fc1's output, over pieces
    of the sequence where memory_model.swiglu_chunks says) gives megatron-core's MLP's
    output bit for bit, and the forward with grad (megatron-core's
    own) the same."""
    from megatron.core.transformer.mlp import MLP

    from megatron.models.swiglu import no_grad_in_place_mlp

    piece = build_piece(CFG.with_dtype(dtype), 1)
    mlp = piece.layer.mlp
    assert isinstance(mlp, no_grad_in_place_mlp())
    x = torch.randn(CFG.seq_length, 2, CFG.hidden_size, dtype=dtype)
    # in bf16 over three pieces of the sequence (its moment above attention's), in fp32 one
    assert mlp._chunks(x) == (3 if dtype == torch.bfloat16 else 1)
    with torch.no_grad():
        in_place = piece(x, {})
        mlp.forward = lambda hidden, per_token_scale=None, **kw: MLP.forward(
            mlp, hidden, per_token_scale, **kw)
        megatron_core = piece(x, {})
        del mlp.forward
    assert torch.equal(in_place, megatron_core)
    assert torch.equal(in_place, piece(x, {}).detach())


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_rope_without_grad_is_megatron_cores_bit_for_bit(dtype):
    """RoPE without grad (rotated in place in the query copy and the keys) gives
    megatron-core's rotation bit for bit, alone and through the layer's attention."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import attention

    from megatron.models import rope

    piece = build_piece(CFG.with_dtype(dtype), 1)
    config = piece.layer.config
    assert attention.apply_rotary_pos_emb is rope.rotary_in_place_without_grad
    freqs = piece._rotary(CFG.seq_length)
    t = torch.randn(CFG.seq_length, 2, 3, freqs.shape[-1], dtype=dtype)
    expected = apply_rotary_pos_emb(t, freqs, config=config)
    with torch.no_grad():
        rotated = rope.rotary_in_place_without_grad(t.clone(), freqs, config, mscale=1.0)
    assert torch.equal(rotated, expected)
    x = torch.randn(CFG.seq_length, 2, CFG.hidden_size, dtype=dtype)
    with torch.no_grad():
        in_place = piece(x, {})
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
        try:
            megatron_core = piece(x, {})
        finally:
            attention.apply_rotary_pos_emb = rope.rotary_in_place_without_grad
    assert torch.equal(in_place, megatron_core)
