"""The skills suite's interval: Wilson's score interval against values computed by hand from its formula."""

import pytest

from neva.evaluate import wilson_interval


def test_wilson_interval_known_values():
    assert wilson_interval(5, 10) == pytest.approx((0.236590, 0.763410), abs=1e-6)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.277540, abs=1e-6)  # > 0 although no answer was right
    assert wilson_interval(200, 200)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)
