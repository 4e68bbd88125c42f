"""The run configuration: what the flags become, what is derived from them, and that a
configuration cannot exist unchecked."""

import dataclasses

import pytest

from megatron.config.errors import ConfigError
from megatron.config.run import RunConfig
from megatron.training.arguments import parse_args

TINY = ["--model-preset", "tiny"]


def test_every_flag_is_a_field_of_one_section_and_round_trips():
    run = parse_args([*TINY, "--stage-layers", "1,3", "--data-parallel-size", "2",
                      "--inject-overflow", "3,1,0", "--bf16", "--hardware", "h100-sxm"])
    assert run.parallel.stage_layers == (1, 3)  # frozen: lists become tuples
    assert run.testing.inject_overflow == (3, 1, 0)
    assert run.model.name == "tiny" and run.precision.dtype == "bf16"
    flags = run.flags()
    assert flags["stage_layers"] == [1, 3] and flags["model_preset"] == "tiny"
    assert RunConfig.from_flags(flags) == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.train_iters = 5


def test_derived_quantities_come_from_one_place():
    run = parse_args([*TINY, "--micro-batch-size", "2", "--global-batch-size", "16",
                      "--data-parallel-size", "2", "--seq-length", "64", "--train-iters", "12",
                      "--split", "90,8,2", "--eval-interval", "5", "--eval-iters", "3"])
    assert run.micro_batches == 4  # per replica: 16 / (2 x 2)
    assert run.tokens_per_iteration == 16 * 64
    assert run.evaluations == 12 // 5 + 1
    assert run.split_sizes == [12 * 16, 3 * 3 * 16, 3 * 16]
    assert run.precision.optimizer_bytes_per_param == 12
    states = parse_args([*TINY, "--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"])
    assert states.precision.optimizer_bytes_per_param == 6


def test_evolve_checks_the_new_configuration_like_the_command_line():
    run = parse_args([*TINY, "--global-batch-size", "8"])
    assert run.evolve(training={"micro_batch_size": 2}).micro_batches == 4
    with pytest.raises(ConfigError) as exc:
        run.evolve(training={"micro_batch_size": 3})
    assert (exc.value.flag, exc.value.value) == ("--global-batch-size", 8)
    with pytest.raises(ConfigError) as exc:
        run.evolve(parallel={"zero_stage": 3})
    assert exc.value.flag == "--zero-stage"


def test_megatrons_evaluation_defaults_are_resolved_not_stored():
    given = parse_args([*TINY, "--split", "969,30,1"])
    assert (given.evaluation.eval_interval, given.evaluation.eval_iters) == (None, None)
    # Megatron-LM 0.16: 100 iterations per evaluation, only at the end without an interval
    assert (given.eval_interval, given.eval_iters, given.evaluations) == (None, 100, 1)
    assert given.evolve(data={"split": "1,0,0"}).eval_iters == 0
