"""The per-group task runner: real overlap, wait_all semantics, errors, shutdown."""

import threading
import time

import pytest

from megatron.optimizer import GroupTaskError, GroupTaskRunner


def runner_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cpu-optimizer")]


def test_caller_keeps_working_while_group_tasks_wait_and_run():
    landed = [threading.Event() for _ in range(3)]
    started = [threading.Event() for _ in range(3)]
    release = [threading.Event() for _ in range(3)]

    def task(group):
        started[group].set()
        assert release[group].wait(10)
        return group

    with GroupTaskRunner(max_workers=3) as runner:
        for group in range(3):
            runner.submit(group, lambda s=group: task(s), landed[group])
        for group in (2, 0, 1):  # gradients land in any order
            assert not started[group].is_set()  # a task waits for its own gradient
            landed[group].set()
            assert started[group].wait(10)
            # the caller is running here while the group's task is in the middle of its step
            assert runner.pending_groups == [0, 1, 2]
            release[group].set()
        assert runner.wait_all() == {0: 0, 1: 1, 2: 2}


def test_wait_all_returns_only_after_every_task():
    done = []
    with GroupTaskRunner(max_workers=2) as runner:
        for group, delay in enumerate((0.05, 0.0, 0.1, 0.02)):
            runner.submit(group, lambda s=group, d=delay: time.sleep(d) or done.append(s))
        runner.wait_all()
        assert sorted(done) == [0, 1, 2, 3]
        assert runner.pending_groups == []


def test_exception_in_a_task_names_the_group_and_keeps_the_others_results():
    with GroupTaskRunner(max_workers=2) as runner:
        runner.submit(0, lambda: "fine")
        runner.submit(3, lambda: 1 / 0)
        with pytest.raises(GroupTaskError, match="group 3.*ZeroDivisionError") as info:
            runner.wait_all()
    assert info.value.group == 3
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.results == {0: "fine"}


def test_failing_ready_signal_surfaces_as_the_group_error():
    def landing_failed():
        raise OSError("copy engine died")

    with GroupTaskRunner() as runner:
        runner.submit(5, lambda: None, landing_failed)
        with pytest.raises(GroupTaskError, match="group 5.*copy engine died"):
            runner.wait_all()


def test_no_thread_survives_close():
    before = len(runner_threads())
    runner = GroupTaskRunner(max_workers=3)
    gate = threading.Event()
    for group in range(3):
        runner.submit(group, lambda: time.sleep(0.01), gate)
    assert len(runner_threads()) > before
    gate.set()
    runner.close()
    assert len(runner_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(0, lambda: None)


def test_one_task_per_group_per_round():
    with GroupTaskRunner() as runner:
        runner.submit(1, lambda: None)
        with pytest.raises(ValueError, match="group 1 already has a task"):
            runner.submit(1, lambda: None)
        runner.wait_all()


def test_thread_setup_runs_once_in_every_worker_before_its_tasks():
    """On CUDA the setup sets each worker's device before it waits on an event."""
    set_up: list[str] = []

    def setup() -> None:
        set_up.append(threading.current_thread().name)

    def task() -> str:
        assert threading.current_thread().name in set_up
        time.sleep(0.01)
        return threading.current_thread().name

    with GroupTaskRunner(max_workers=2, thread_setup=setup) as runner:
        for group in range(6):
            runner.submit(group, task)
        ran_on = set(runner.wait_all().values())
    assert ran_on <= set(set_up)
    assert len(set_up) == len(set(set_up)) <= 2
