import pytest

from megatron.optimizer import ConstantLossScaler, DynamicLossScaler


def test_backoff_halves_and_stops_at_the_minimum():
    s = DynamicLossScaler(2.0**4, backoff_factor=0.5, min_scale=2.0)
    seen = []
    for _ in range(5):
        s.update(found_overflow=True)
        seen.append(s.scale)
    assert seen == [8.0, 4.0, 2.0, 2.0, 2.0]
    assert s.inv_scale == 0.5


def test_growth_after_interval_of_clean_iterations_in_a_row():
    s = DynamicLossScaler(8.0, growth_factor=2.0, growth_interval=3)
    for found in (False, False, True, False, False):  # the overflow restarts the count
        s.update(found)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0


def test_state_dict_round_trip():
    s = DynamicLossScaler(1024.0, growth_interval=4)
    s.update(False)
    t = DynamicLossScaler(1.0, growth_interval=4)
    t.load_state_dict(s.state_dict())
    for _ in range(3):
        t.update(False)
    assert t.scale == 2048.0


def test_constant_scaler_never_changes():
    s = ConstantLossScaler()
    s.update(True)
    assert (s.scale, s.inv_scale) == (1.0, 1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"initial_scale": 0.0}, "initial_scale=0.0"), ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
     ({"growth_interval": 0}, "growth_interval=0"), ({"min_scale": 1e9}, "min_scale=1000000000.0")],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)
