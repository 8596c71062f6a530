"""``_evidence.all_finite``: the one-reduction test run after every forward (a cache's tensors, each ``update()``'s
answer) agrees with the element-wise ``torch.isfinite(t).all()`` on every floating dtype, and on the values where a
sum could mislead (large finite values, inf beside -inf, a float64 sum that overflows)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconform.checks._evidence import all_finite, nonfinite_in

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
INF, NAN = float("inf"), float("nan")


def _elementwise(t) -> bool:
    return bool(torch.isfinite(t.double()).all())  # exact for every dtype (no isfinite for float8_e4m3fn on CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("values", [[0.5, -2.0, 3.0], [NAN, 1.0], [INF, 1.0], [-INF, 1.0], [INF, -INF], [NAN]],
                         ids=["finite", "nan", "inf", "-inf", "inf_and_-inf", "only_nan"])
def test_agrees_with_the_elementwise_test(dtype, values):
    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert all_finite(t) is _elementwise(t)


def test_large_finite_values_are_finite_although_their_float32_sum_overflows():
    t = torch.full((4, 2), 3e38)
    assert not torch.isfinite(t.sum())  # the reduction in the tensor's own dtype would say "not finite"
    assert all_finite(t)


def test_a_float64_sum_that_overflows_falls_back_to_the_elementwise_test():
    assert all_finite(torch.full((3,), 1.7e308, dtype=torch.float64))
    assert not all_finite(torch.tensor([1.7e308, NAN], dtype=torch.float64))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_agrees_on_drawn_values(values, dtype):
    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert all_finite(t) is _elementwise(t)


def test_nonfinite_in_still_names_the_position():
    class Layer:
        def __init__(self):
            self.keys = torch.zeros(1, 2, 4, 3)
            self.values = torch.zeros(1, 2, 4, 3)

    class Cache:
        layers = [Layer(), Layer()]

    cache = Cache()
    assert nonfinite_in(cache) is None
    cache.layers[1].values[0, 1, 2, 0] = INF
    assert nonfinite_in(cache) == "layers[1].values[batch 0, head 1, position 2]"
    cache.layers[1].values = torch.zeros(1, 2, 4, 3)
    cache.layers[0].keys = torch.zeros(1, 2, 4, 3).to(torch.float8_e4m3fn)
    assert nonfinite_in(cache) is None
    cache.layers[0].keys[0, 0, 3, 1] = NAN  # fp8 (e4m3fn has NaN, no inf): measured too
    assert nonfinite_in(cache) == "layers[0].keys[batch 0, head 0, position 3]"
