"""A training run against Megatron-LM 0.19's training loop, written here on its own terms.

This project trains a few iterations in one process (fp32, three micro-batches per global
batch, clipping that clips in some iterations; SCHEDULES: by iterations with warmup,
cosine decay and weight decay, or by samples with a warmup ending within an iteration and
a rising weight decay) and saves every iteration. The reference is megatron-core's
GPTModel with megatron-core's stock local layer spec, its weights read by megatron-core's
dist_checkpointing from the checkpoint of iteration 1 (the initial weights: Megatron's
warmup runs iteration 1 at --lr-warmup-init, 0), trained by the loop below with
Megatron-LM 0.19's semantics, none of them taken from this project's code:

- param groups as megatron/core/optimizer get_standard_config_overrides builds them: no
  weight decay on biases and 1-D parameters (norm weights); the embedding and the output
  layer are decayed;
- torch.optim.AdamW, megatron-core's OptimizerParamScheduler built as
  megatron/training/training.py get_optimizer_param_scheduler builds it (steps count
  samples: iterations times the global batch; with --train-samples the weight decay
  increment spans the samples) and stepped after each successful update by the global
  batch;
- the samples of a global batch in MegatronPretrainingSampler's order, stacked by
  default_collate;
- each micro-batch's loss as pretrain_gpt.py's loss_func returns it (masked sum, tokens)
  divided as schedules.forward_step_calc_loss divides it without
  --calculate-per-token-loss (by the micro-batch's tokens, then by the number of
  micro-batches), gradients accumulated over the micro-batches;
- global-norm clipping (torch.nn.utils.clip_grad_norm_: Megatron's coefficient
  max_norm / (norm + 1e-6) when below 1), the reported norm the one before clipping;
- the reported loss the global batch's masked sum over its tokens (train_step), the
  reported learning rate the one after the scheduler's step (training_log).

Compared: per iteration the loss, the gradient norm and the learning rate; after the last
iteration every weight and both Adam moments, read back from this project's checkpoint by
megatron-core. fp32 on both sides: they differ by kernel order only. Each mutation of one
Megatron semantic in the reference must break the agreement (the comparison can fail).
Every token counts here (no --eod-mask-loss, no padded sample), so Megatron's two loss
averagings (per micro-batch, per token of the global batch) agree and are not told apart.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron.data.run_data import prepare_data
from megatron.training.arguments import parse_args
from megatron.training.distributed import initialize_distributed, shutdown_distributed
from megatron.training.training import train

LAYERS, HIDDEN, FFN, HEADS, GROUPS, SEQ, VOCAB = 2, 64, 160, 4, 2, 32, 128
MICRO, GLOBAL, ITERS = 2, 6, 5
LR, MIN_LR, CLIP = 1e-2, 1e-3, 1.5
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
         "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
         "--group-query-attention", "--num-query-groups", str(GROUPS),
         "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO),
         "--global-batch-size", str(GLOBAL), "--lr", str(LR), "--min-lr", str(MIN_LR),
         "--clip-grad", str(CLIP), "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB), "--eval-iters", "0", "--save-interval", "1"]
# Megatron-LM's schedule arguments (args.*) and the same as flags: by iterations with warmup
# and cosine decay; by samples (ITERS whole global batches and 2 samples more), warmup
# ending within an iteration, linear decay and a weight decay rising linearly.
SCHEDULES = {
    "iterations": {"train_iters": ITERS, "lr_warmup_iters": 2, "lr_decay_style": "cosine",
                   "weight_decay": 0.1},
    "samples": {"train_samples": ITERS * GLOBAL + 2, "lr_warmup_samples": 9,
                "lr_decay_style": "linear", "start_weight_decay": 0.0,
                "end_weight_decay": 0.1, "weight_decay_incr_style": "linear"},
}
TOLERANCE = 1e-5  # relative, fp32 kernel-order differences only
MUTATIONS = ("decay_norms", "no_decay_on_embeddings", "lr_stepped_before_update",
             "micro_batch_losses_summed", "clip_after_update")


def schedule_flags(schedule: dict) -> list[str]:
    return [f for key, value in schedule.items()
            for f in ("--" + key.replace("_", "-"), str(value))]


@pytest.fixture(scope="module", params=list(SCHEDULES))
def our_run(request, tmp_path_factory):
    """This project's run with one of SCHEDULES (its per-iteration records, its checkpoint
    directory, its config, the schedule), in a process group the reference's GPTModel
    uses too."""
    root = tmp_path_factory.mktemp(request.param)
    schedule = SCHEDULES[request.param]
    run = parse_args([*FLAGS, *schedule_flags(schedule), "--save", str(root / "ckpt"),
                      "--data-cache-path", str(root / "cache")])
    dist_info = initialize_distributed()
    try:
        yield train(run, dist_info), str(root / "ckpt"), run, schedule
    finally:
        shutdown_distributed()


def megatron_param_scheduler(optimizer, schedule: dict):
    """megatron-core's OptimizerParamScheduler as Megatron-LM 0.19's
    get_optimizer_param_scheduler builds it from its arguments (defaults: Megatron's)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = {"train_iters": None, "train_samples": None, "lr_decay_iters": None,
            "lr_decay_samples": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
            "lr_warmup_fraction": None, "lr_warmup_init": 0.0, "weight_decay": 0.01,
            "start_weight_decay": None, "end_weight_decay": None,
            "weight_decay_incr_style": "constant", "global_batch_size": GLOBAL, **schedule}
    a = types.SimpleNamespace(**args)
    if a.weight_decay_incr_style == "constant":  # Megatron's arguments.py: --weight-decay
        a.start_weight_decay = a.end_weight_decay = a.weight_decay
    if a.train_iters:
        a.lr_decay_iters = a.lr_decay_iters or a.train_iters
        decay_steps = a.lr_decay_iters * a.global_batch_size
        wd_incr_steps = a.train_iters * a.global_batch_size
        warmup_steps = a.lr_warmup_iters * a.global_batch_size
    else:
        a.train_iters = a.train_samples // a.global_batch_size  # update_train_iters
        a.lr_decay_samples = a.lr_decay_samples or a.train_samples
        decay_steps = a.lr_decay_samples
        wd_incr_steps = a.train_samples
        warmup_steps = a.lr_warmup_samples
    if a.lr_warmup_fraction is not None:
        warmup_steps = a.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=a.lr_warmup_init, max_lr=LR, min_lr=MIN_LR,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=a.lr_decay_style, start_wd=a.start_weight_decay,
        end_wd=a.end_weight_decay, wd_incr_steps=wd_incr_steps,
        wd_incr_style=a.weight_decay_incr_style), a.train_iters


def gpt_model():
    """megatron-core's GPTModel of FLAGS' LLaMA: its own local spec, RMSNorm, SwiGLU,
    RoPE, no biases, untied output layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)
    return GPTModel(config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def load_checkpoint(directory: str):
    """A GPTModel with the weights of `directory`, and the Adam moments saved there, read
    by megatron-core's dist_checkpointing as Megatron-LM's load does."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model = gpt_model()
    sharded = {k: v for k, v in model.sharded_state_dict().items()
               if not k.endswith("_extra_state")}
    moments = {prefix: {name: make_sharded_optimizer_tensor(
        sharded[name], torch.empty_like(p), f"optimizer.state.{prefix}")
        for name, p in model.named_parameters()} for prefix in ("exp_avg", "exp_avg_sq")}
    loaded = dist_checkpointing.load({"model": sharded, **moments}, directory)
    result = model.load_state_dict(loaded["model"], strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    return model, loaded["exp_avg"], loaded["exp_avg_sq"]


def megatron_lm_training(initial: str, dataset, schedule: dict,
                         mutation: str | None = None):
    """Megatron-LM 0.19's loop from the weights in `initial` with `schedule` (SCHEDULES):
    the records (loss, grad norm, lr), the model and its optimizer. `mutation` changes one
    semantic (MUTATIONS) to show the comparison catches it."""
    model, _, _ = load_checkpoint(initial)
    named = list(model.named_parameters())

    def wd_mult(name: str, p: torch.Tensor) -> float:
        if mutation == "decay_norms":
            return 1.0
        if mutation == "no_decay_on_embeddings" and ("embedding" in name
                                                     or "output_layer" in name):
            return 0.0
        return 0.0 if len(p.shape) == 1 or name.endswith(".bias") else 1.0

    groups = [{"params": [p for n, p in named if wd_mult(n, p) == mult], "wd_mult": mult}
              for mult in (1.0, 0.0)]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    scheduler, iterations = megatron_param_scheduler(optimizer, schedule)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    micro_batches = GLOBAL // MICRO
    params = [p for _, p in named]
    records = []
    for iteration in range(iterations):
        if mutation == "lr_stepped_before_update":
            scheduler.step(increment=GLOBAL)
        optimizer.zero_grad()
        loss_sum, tokens = 0.0, 0
        for j in range(micro_batches):
            first = iteration * GLOBAL + j * MICRO  # MegatronPretrainingSampler's order
            samples = [dataset[first + k] for k in range(MICRO)]
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                     for key in ("tokens", "labels", "loss_mask", "position_ids")}
            losses = model(batch["tokens"], batch["position_ids"], causal,
                           labels=batch["labels"])
            mask = batch["loss_mask"].view(-1).float()
            loss = torch.sum(losses.view(-1).float() * mask)
            num_tokens = mask.sum()
            scaled = loss / num_tokens.clamp(min=1)
            if mutation != "micro_batch_losses_summed":
                scaled = scaled / micro_batches
            scaled.backward()
            loss_sum, tokens = loss_sum + float(loss.detach()), tokens + int(num_tokens)
        if mutation == "clip_after_update":
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP))
        optimizer.step()
        if mutation == "clip_after_update":
            torch.nn.utils.clip_grad_norm_(params, CLIP)  # too late: no effect
        if mutation != "lr_stepped_before_update":
            scheduler.step(increment=GLOBAL)
        records.append({"loss": loss_sum / tokens, "grad_norm": norm,
                        "lr": optimizer.param_groups[0]["lr"]})
    return records, model, optimizer


def relative_differences(our_run, mutation: str | None = None) -> dict[str, float]:
    """The largest relative difference between this project's run and the reference, per
    quantity: per-iteration loss, grad norm and lr; final weights and Adam moments (per
    tensor, the largest element difference over the tensor's largest magnitude)."""
    records, checkpoints, run, schedule = our_run
    dataset = prepare_data(run, log=lambda *_: None).datasets.train
    reference, model, optimizer = megatron_lm_training(f"{checkpoints}/iter_0000001", dataset,
                                                       schedule, mutation)
    assert [r["iteration"] for r in records] == list(range(1, len(reference) + 1))
    worst = {key: max(abs(ours[key] - theirs[key]) / abs(theirs[key])
                      for ours, theirs in zip(records, reference))
             for key in ("loss", "grad_norm", "lr")}
    final, exp_avg, exp_avg_sq = load_checkpoint(f"{checkpoints}/iter_{len(records):07d}")
    ours = dict(final.named_parameters())
    for name, p in model.named_parameters():
        p, state = p.detach(), optimizer.state[p]
        for key, mine, theirs in (("weights", ours[name], p),
                                  ("exp_avg", exp_avg[name], state["exp_avg"]),
                                  ("exp_avg_sq", exp_avg_sq[name], state["exp_avg_sq"])):
            difference = float((mine - theirs).abs().max() / theirs.abs().max())
            worst[key] = max(worst.get(key, 0.0), difference)
    return worst


def test_a_run_follows_megatron_lm_training_iteration_by_iteration(our_run):
    records = our_run[0]
    # the run exercises what it is meant to: clipping in some iterations, not in all
    clipped = [r["grad_norm"] > CLIP for r in records]
    assert any(clipped) and not all(clipped), [r["grad_norm"] for r in records]
    worst = relative_differences(our_run)
    assert all(difference <= TOLERANCE for difference in worst.values()), worst


@pytest.mark.parametrize("our_run", ["iterations"], indirect=True)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_comparison_catches_one_changed_megatron_semantic(our_run, mutation):
    worst = relative_differences(our_run, mutation)
    assert max(worst.values()) > 100 * TOLERANCE, worst
