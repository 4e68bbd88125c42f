"""The one device decision: what it chooses, what it refuses, and the state it leaves
megatron-core in on each path.

The CUDA branch is driven here on a machine without a GPU, with CUDA's availability, its
set_device and its RNG calls stood in for (not by taking the CPU branch): the first GPU run
failed at the first forward pass because megatron-core's RNG tracker was set up only on the
CPU path, which no CPU test could see.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mcore_random

from megatron.config.device_choice import DeviceChoice, choose_device
from megatron.config.errors import ConfigError
from megatron.models import cpu_adaptation
from megatron.models.llama import (
    LlamaConfig,
    build_piece,
    layer_implementation,
    norm_module,
)
from megatron.models.rms_norm import RMSNorm
from megatron.training import distributed
from megatron.training.distributed import (
    apply_device,
    initialize_distributed,
    process_group_options,
)

MEGATRON_STATES = {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
CFG = LlamaConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=64, seq_length=8, seed=3)


@pytest.fixture(autouse=True)
def no_group_left_behind():
    """The tests that build pieces start a process group (megatron-core's layers read its
    parallel state); none outlives its test: the tests after this module would inherit it
    (a fork is refused with one, tests/in_child.py, and main() would not start its own)."""
    yield
    distributed.shutdown_distributed()


def test_one_gpu_per_process_over_nccl():
    assert choose_device(True, 8, local_rank=3, local_world_size=8) == DeviceChoice(
        "cuda", 3, "nccl")
    assert choose_device(False, 0, local_rank=3, local_world_size=4) == DeviceChoice(
        "cpu", 0, "gloo")


def test_nccl_is_bound_to_the_ranks_gpu_at_init():
    """Eager NCCL init: the world communicator exists before the first batched
    point-to-point exchange (torch requires every rank in a group's first operation)."""
    nccl = choose_device(True, 8, local_rank=3, local_world_size=8)
    assert process_group_options(nccl) == {"device_id": torch.device("cuda", 3)}
    assert process_group_options(choose_device(False, 0, 3, 4)) == {}
    assert process_group_options(choose_device(True, 1, 1, 2, share_gpu=True)) == {}


def test_more_processes_than_gpus_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        choose_device(True, 1, local_rank=1, local_world_size=2)
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith("--nproc-per-node 2: at most 1 (this node has 1 GPU")
    assert "--share-gpu" in line


def test_shared_gpu_test_mode_runs_gloo_and_stages_transfers():
    choice = choose_device(True, 1, local_rank=1, local_world_size=2, share_gpu=True)
    assert choice == DeviceChoice("cuda", 0, "gloo", shared_gpu=True)
    assert choice.stages_transfers_through_host
    assert not choose_device(True, 2, 1, 2).stages_transfers_through_host


def test_the_refusal_comes_before_any_process_group_or_allocation(monkeypatch):
    if dist.is_initialized():
        distributed.shutdown_distributed()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    set_device_calls = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device_calls.append)
    with pytest.raises(ConfigError, match="--nproc-per-node 2"):
        initialize_distributed()
    assert not dist.is_initialized() and set_device_calls == []


@pytest.fixture
def cuda_stood_in(monkeypatch):
    """CUDA's RNG calls answered by a host generator, set_device recorded, and the host
    adaptation forbidden: what the CUDA branch does, seen from a machine without CUDA."""
    generator = torch.Generator()
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: generator.get_state())
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: generator.manual_seed(seed))
    monkeypatch.setattr(mcore_random, "_get_cuda_rng_state",
                        lambda *a, **k: generator.get_state())
    monkeypatch.setattr(mcore_random, "_set_cuda_rng_state",
                        lambda state, *a, **k: generator.set_state(state))

    def host_adaptation_on_cuda():
        raise AssertionError("the CUDA branch adapted megatron-core for a host without CUDA")

    monkeypatch.setattr(cpu_adaptation, "adapt_megatron_core_for_host", host_adaptation_on_cuda)
    set_device_calls: list[int] = []
    yield set_device_calls
    # leave the process as the CPU path set it up for the tests after this one
    monkeypatch.undo()
    cpu_adaptation.set_up_megatron_core("cpu", 1234)


def test_cuda_branch_seeds_megatron_cores_tracker_as_megatron_does(cuda_stood_in):
    mcore_random.initialize_rng_tracker(force_reset=True)  # as a fresh process has it
    assert cpu_adaptation.rng_tracker_states() == set()
    apply_device(DeviceChoice("cuda", 1, "nccl"), seed=42, set_cuda_device=cuda_stood_in.append)
    assert cuda_stood_in == [1]
    assert cpu_adaptation.rng_tracker_states() == MEGATRON_STATES
    # Megatron-LM's seeds: the tensor-parallel state from seed + 2718 (+ tp rank 0)
    expected = torch.Generator().manual_seed(42 + 2718).get_state()
    states = mcore_random.get_cuda_rng_tracker().get_states()
    assert torch.equal(states["model-parallel-rng"], expected)
    with mcore_random.get_cuda_rng_tracker().fork():  # what DotProductAttention does
        pass


def test_a_forward_without_the_setup_fails_on_the_cpu_as_it_does_on_cuda():
    """The CPU path keeps megatron-core's real tracker: forgetting the device setup shows
    here with CUDA's own error, not first on a GPU. megatron-core's unfused attention reads
    the tracker (for its dropout); SDPA, without dropout, does not."""
    initialize_distributed()
    piece = build_piece(replace(CFG, attention_backend="unfused"), 1)
    hidden = torch.randn(CFG.seq_length, 2, CFG.hidden_size)
    mcore_random.initialize_rng_tracker(force_reset=True)
    try:
        with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"):
            piece(hidden, {})
    finally:
        cpu_adaptation.set_up_megatron_core("cpu", 1234)
    assert piece(hidden, {}).shape == hidden.shape


@pytest.mark.parametrize("cuda,te,expected", [
    (False, True, "local"), (True, False, "local"), (True, True, "transformer_engine")])
def test_layer_implementation_follows_what_imports(cuda, te, expected):
    assert layer_implementation(cuda_available=cuda, te_importable=te) == expected


def test_head_norm_is_rmsnorm_when_apex_would_give_layernorm(monkeypatch):
    """With apex importable (and no Transformer Engine), megatron-core's transformer_block
    picks apex's FusedLayerNorm, which asserts LayerNorm: the head must not take it."""
    from megatron.core.transformer import transformer_block

    class ApexFusedLayerNorm:
        def __init__(self, config, *args, **kwargs):
            assert config.normalization == "LayerNorm", "FusedLayerNorm: LayerNorm only"

    monkeypatch.setattr(transformer_block, "LayerNormImpl", ApexFusedLayerNorm)
    initialize_distributed()
    head = build_piece(CFG, CFG.num_layers + 1)
    layer = build_piece(CFG, 1)
    assert isinstance(head.final_layernorm, torch.nn.RMSNorm)
    assert type(head.final_layernorm) is type(layer.layer.input_layernorm)
    assert norm_module("local") is RMSNorm


def test_transformer_engines_fused_norm_names_are_saved_under_the_local_specs():
    """TE's spec fuses each RMSNorm into the linear after it; checkpoints keep the local
    spec's names so that a GPU run with TE and a CPU run read each other's."""
    from megatron.training.checkpoint_state import checkpoint_name

    initialize_distributed()
    local = {checkpoint_name(CFG, f"pieces.1.{n}") for n, _ in build_piece(CFG, 1).named_parameters()}
    for te_name, local_name in (
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")):
        saved = checkpoint_name(CFG, f"pieces.1.layer.{te_name}")
        assert saved == f"decoder.layers.0.{local_name}" and saved in local
