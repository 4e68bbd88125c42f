"""Which samples an iteration or an evaluation reads: a fixed slice of the sample order, so
every process of a pipeline, every data-parallel replica and every resumed run sees the
same data.

With D data-parallel replicas a global batch is split as Megatron's sampler splits it:
step j of the replicas takes the j-th D micro-batches, replica r the r-th of them.
"""

from __future__ import annotations

from megatron.config.run import RunConfig
from megatron.data.datasets import micro_batch_at
from megatron.models.llama import Batch


def _global_batch(dataset, run: RunConfig, first: int, data_parallel_rank: int) -> list[Batch]:
    """This replica's micro-batches of the global batch that starts at micro-batch `first`."""
    d = run.data_parallel_size
    return [micro_batch_at(dataset, run.training.micro_batch_size,
                           first + j * d + data_parallel_rank)
            for j in range(run.micro_batches)]


def training_micro_batches(dataset, iteration: int, run: RunConfig,
                           data_parallel_rank: int = 0) -> list[Batch]:
    """The micro-batches of training iteration `iteration` (1-based)."""
    per_batch = run.micro_batches * run.data_parallel_size
    return _global_batch(dataset, run, (iteration - 1) * per_batch, data_parallel_rank)


def evaluation_micro_batches(dataset, number: int, run: RunConfig,
                             data_parallel_rank: int = 0) -> list[list[Batch]]:
    """The micro-batches of evaluation `number`: eval_iters global batches (this replica's
    share of each), the k-th evaluation reading the k-th run of them."""
    per_batch = run.micro_batches * run.data_parallel_size
    iters = run.eval_iters
    return [_global_batch(dataset, run, (number * iters + i) * per_batch, data_parallel_rank)
            for i in range(iters)]
