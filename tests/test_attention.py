"""Core attention through torch's SDPA against megatron-core's unfused DotProductAttention.

One decoder layer, forward and backward, built from both local specs with the same weights:
the outputs and every gradient agree within 1e-5 in fp32. The pipeline-vs-one-process tests
then run the SDPA layers (the default) on every schedule.
"""

import pytest
import torch

from megatron.config.model import materializes_attention_scores
from megatron.models.attention import SDPAttention, core_attention_kernel
from megatron.models.llama import LlamaConfig, build_piece
from megatron.training.arguments import parse_args
from megatron.training.distributed import initialize_distributed, shutdown_distributed


@pytest.fixture(scope="module", autouse=True)
def _dist():
    initialize_distributed()
    yield
    shutdown_distributed()


def _layer(backend: str, groups: int, seq: int = 32) -> torch.nn.Module:
    cfg = LlamaConfig(num_layers=1, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                      num_query_groups=groups, vocab_size=128, seq_length=seq, seed=5,
                      attention_backend=backend)
    return build_piece(cfg, 1)


def _forward_backward(piece: torch.nn.Module, hidden: torch.Tensor):
    x = hidden.clone().requires_grad_(True)
    out = piece(x, {})
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), x.grad, {n: p.grad for n, p in piece.named_parameters()}


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_sdpa_layer_equals_the_unfused_layer_forward_and_backward(groups):
    sdpa, unfused = _layer("auto", groups), _layer("unfused", groups)
    assert isinstance(sdpa.layer.self_attention.core_attention, SDPAttention)
    assert type(unfused.layer.self_attention.core_attention).__name__ == "DotProductAttention"
    # same parameter names (checkpoints unchanged), and the same weights
    assert sdpa.state_dict().keys() == unfused.state_dict().keys()
    unfused.load_state_dict(sdpa.state_dict())
    hidden = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(1))
    out, dx, grads = _forward_backward(sdpa, hidden)
    ref_out, ref_dx, ref_grads = _forward_backward(unfused, hidden)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=name)


def test_sdpa_attends_causally_without_a_sequence_by_sequence_tensor():
    """A fused kernel holds no seq x seq tensor, in the piece or in autograd: fp32 without
    grouped-query attention (the memory-efficient kernel on CUDA, the CPU's flash here).
    With grouped-query attention fp32 has only math on CUDA, which keeps the probabilities;
    so does the unfused layer, which also builds the causal mask (the check can fail)."""
    seq = 48

    def square_tensors(piece):
        found = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-2:] == (seq, seq):
                found.append(tuple(t.shape))
            return t

        hidden = torch.randn(seq, 1, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            piece(hidden, {})
        _, mask = piece._rope_and_mask(seq, hidden.device)
        return found, mask

    assert square_tensors(_layer("flash", 4, seq)) == ([], None)
    found, mask = square_tensors(_layer("flash", 2, seq))
    assert found and mask is None
    found, mask = square_tensors(_layer("local", 2, seq))
    assert found and mask is not None and mask.shape[-2:] == (seq, seq)


def test_a_given_mask_is_honoured_as_megatron_core_reads_it():
    """True = masked, as in megatron-core: the causal mask given equals is_causal."""
    piece = _layer("auto", 2)
    attention = piece.layer.self_attention.core_attention
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(16, 2, 4, 16, generator=g), *torch.randn(2, 16, 2, 2, 16, generator=g)
    causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    torch.testing.assert_close(attention(q, k, v, causal), attention(q, k, v, None),
                               rtol=0, atol=1e-6)
    assert not torch.allclose(attention(q, k, v, ~causal.tril()), attention(q, k, v, None))


def test_attention_backend_flag_picks_the_kernel():
    """Megatron-LM's --attention-backend: unfused and local keep megatron-core's
    DotProductAttention, the default (auto) and flash/fused take SDPA."""
    assert parse_args(["--model-preset", "tiny"]).model.attention_backend == "auto"
    picked = {}
    for value in ("flash", "fused", "unfused", "local", "auto"):
        run = parse_args(["--model-preset", "tiny", "--attention-backend", value])
        picked[value] = core_attention_kernel(run.model.attention_backend)
        assert materializes_attention_scores(value) == (picked[value] == "unfused")
    assert picked == {"flash": "sdpa", "fused": "sdpa", "unfused": "unfused",
                      "local": "unfused", "auto": "sdpa"}
