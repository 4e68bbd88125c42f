"""An output that fails mid-run (the metrics file on a full disk, TensorBoard's event file
over a size limit) stops with one warning line and takes nothing else down."""

import contextlib
import resource
import signal

import pytest

from megatron.training.arguments import parse_args
from megatron.training.metrics import MetricsWriter
from megatron.training.scalar_logging import ScalarSinks

pytestmark = pytest.mark.unit
RECORD = {"iteration": 1, "loss": 8.3, "lr": 1e-3, "consumed_samples": 8,
          "global_batch_size": 8, "tokens_per_s": 100.0}


def test_a_metrics_file_on_a_full_disk_warns_once_and_stops():
    said = []
    writer = MetricsWriter("/dev/full", warn=said.append)  # every write: ENOSPC
    for iteration in range(1, 4):
        writer.write({**RECORD, "iteration": iteration})
    writer.close()
    assert said == ["pretrain_llama.py: warning: --metrics-file /dev/full: writing failed "
                    "(No space left on device); nothing more is written there, training "
                    "goes on"]


@contextlib.contextmanager
def file_size_limit(nbytes):
    """Writes past `nbytes` in a file fail with EFBIG (SIGXFSZ ignored), as on a full disk."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)


def test_a_tensorboard_write_that_fails_warns_once_and_stops(tmp_path, capsys):
    run = parse_args(["--model-preset", "tiny", "--tensorboard-dir", str(tmp_path / "tb")])
    sinks = ScalarSinks(run, enabled=True)
    with file_size_limit(4096):
        for iteration in range(1, 200):  # the event file passes 4 KiB: its writer fails
            sinks.training({**RECORD, "iteration": iteration})
        sinks.close()  # flushes: a failure not seen by a write yet surfaces here
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pretrain_llama.py: warning: --tensorboard-dir {tmp_path / 'tb'}: writing "
                   "failed (File too large); nothing more is written there, training goes on"]
