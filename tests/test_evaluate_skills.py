"""The skills suite's interval: Wilson's score interval against values computed by hand from its formula."""

import pytest

from neva.evaluate import wilson_interval


def test_wilson_interval_known_values():
    assert wilson_interval(5, 10) == pytest.approx((0.236590, 0.763410), abs=1e-6)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.277540, abs=1e-6)  # > 0 although no answer was right
    assert wilson_interval(200, 200)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)


def test_outside_bands_names_each_number_outside_and_a_missing_skill():
    from neva.evaluate import outside_bands

    bands = {
        "overall": {"accuracy": [0.6, 0.8], "reply_prob": [0.5, 0.7]},
        "skills": {"count": {"accuracy": [0.9, 1.0], "reply_prob": [0.6, 0.8]}, "text": {"accuracy": [0.9, 1.0]}},
    }
    result = {"accuracy": 0.7, "reply_prob": 0.75, "skills": {"count": {"accuracy": 0.9, "reply_prob": 0.5}}}
    assert outside_bands(result, bands) == {
        "overall reply_prob": (0.75, [0.5, 0.7]),
        "count reply_prob": (0.5, [0.6, 0.8]),
        "text accuracy": (pytest.approx(float("nan"), nan_ok=True), [0.9, 1.0]),
    }
    inside = {"accuracy": 0.6, "reply_prob": 0.7, "skills": {"count": {"accuracy": 1.0, "reply_prob": 0.6},
                                                              "text": {"accuracy": 0.95}}}  # fmt: skip
    assert outside_bands(inside, bands) == {}
