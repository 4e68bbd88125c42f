"""Validation and test loss, as Megatron computes and prints them.

An evaluation runs `--eval-iters` global batches forward only, through the same
`TrainStep` as training (a pipeline runs its schedule's forward-only program). Evaluation
number k reads the k-th run of eval_iters batches of its split, so every rank and every
resumed run evaluates the same samples: number i // eval_interval - 1 at iteration i, and
train_iters // eval_interval for the one at the end of training.
"""

from __future__ import annotations

import argparse
import math

from megatron.core import parallel_state

from megatron.models.llama import Batch
from megatron.training.train_dataset import micro_batch_at
from megatron.training.train_step import TrainStep

MAX_PPL_EXPONENT = 20  # Megatron prints exp(min(20, loss)) as the perplexity


def evaluation_batches(dataset, number: int, args: argparse.Namespace,
                       data_parallel_rank: int = 0) -> list[list[Batch]]:
    """The micro-batches of evaluation `number`: eval_iters lists of global / micro each
    (with D data-parallel replicas, this replica's share: global / micro / D, split as
    the training batches are)."""
    d = getattr(args, "data_parallel_size", 1)
    count = args.global_batch_size // (args.micro_batch_size * d)
    first = number * args.eval_iters * count * d
    return [[micro_batch_at(dataset, args.micro_batch_size,
                            first + (i * count + j) * d + data_parallel_rank)
             for j in range(count)] for i in range(args.eval_iters)]


def evaluate(step: TrainStep, dataset, number: int, args: argparse.Namespace) -> float:
    """Mean lm loss of evaluation `number` on `dataset`."""
    rank = (parallel_state.get_data_parallel_rank()
            if parallel_state.model_parallel_is_initialized() else 0)
    return step.evaluate(evaluation_batches(dataset, number, args, rank))


def perplexity(loss: float) -> float:
    return math.exp(min(MAX_PPL_EXPONENT, loss))


def format_evaluation(where: str, loss: float) -> str:
    """Megatron's three lines: dashes, ' validation loss at iteration 5 | lm loss value: ...
    | lm loss PPL: ... | ', dashes (Megatron says "validation loss" for the test set too:
    'validation loss at the end of training for test data')."""
    text = (f" validation loss at {where} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {perplexity(loss):.6E} | ")
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def due(iteration: int, args: argparse.Namespace) -> bool:
    """Evaluate after this iteration (Megatron: every eval_interval iterations)."""
    return args.eval_iters > 0 and iteration % args.eval_interval == 0


def evaluation_record(iteration: int, split: str, loss: float, end_of_training: bool) -> dict:
    """The metrics-file line of one evaluation (told apart by its "evaluation" key)."""
    return {"iteration": iteration, "evaluation": split, "lm_loss": loss,
            "lm_loss_ppl": perplexity(loss), "end_of_training": end_of_training}
