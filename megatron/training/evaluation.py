"""Validation and test loss, as Megatron computes and prints them.

An evaluation runs `--eval-iters` global batches forward only, through the same
`TrainStep` as training (a pipeline runs its schedule's forward-only program). Evaluation
number k reads the k-th run of eval_iters batches of its split, so every rank and every
resumed run evaluates the same samples: number i // eval_interval - 1 at iteration i, and
train_iters // eval_interval for the one at the end of training.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state

from megatron.config.run import RunConfig
from megatron.data.sampling import evaluation_micro_batches
from megatron.training.train_step import TrainStep, on_device

MAX_PPL_EXPONENT = 20  # Megatron prints exp(min(20, loss)) as the perplexity


def evaluate(step: TrainStep, dataset, number: int, run: RunConfig,
             device: torch.device) -> float:
    """Mean lm loss of evaluation `number` on `dataset` (its batches placed on `device`)."""
    rank = (parallel_state.get_data_parallel_rank()
            if parallel_state.model_parallel_is_initialized() else 0)
    return step.evaluate([on_device(micro_batches, device) for micro_batches
                          in evaluation_micro_batches(dataset, number, run, rank)])


def perplexity(loss: float) -> float:
    return math.exp(min(MAX_PPL_EXPONENT, loss))


def format_evaluation(where: str, loss: float) -> str:
    """Megatron's three lines: dashes, ' validation loss at iteration 5 | lm loss value: ...
    | lm loss PPL: ... | ', dashes (Megatron says "validation loss" for the test set too:
    'validation loss at iteration 100 on test set', its words at the end of training)."""
    text = (f" validation loss at {where} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {perplexity(loss):.6E} | ")
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def due(iteration: int, run: RunConfig) -> bool:
    """Evaluate after this iteration (Megatron: every eval_interval iterations)."""
    return run.eval_iters > 0 and bool(run.eval_interval) and iteration % run.eval_interval == 0


def evaluation_record(iteration: int, split: str, loss: float, end_of_training: bool) -> dict:
    """The metrics-file line of one evaluation (told apart by its "evaluation" key)."""
    return {"iteration": iteration, "evaluation": split, "lm_loss": loss,
            "lm_loss_ppl": perplexity(loss), "end_of_training": end_of_training}
