"""The suites' scoring: Wilson's score interval against values computed by hand from its formula, the bands, the controls."""

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


class MediaEcho:
    """Stands in for the model: answers each item with the name of its first image or video, ``none`` without."""

    def __init__(self) -> None:
        self.fed: list[tuple] = []

    def answer_all(self, items, batch_size):
        self.fed.extend(items)
        return [f" {(list(images) + list(videos) or ['none'])[0]} " for _, images, videos in items]


def test_controls_swap_media_among_questions_with_as_many_and_drop_them():
    """Every suite's controls (skills, detail, video): ``swapped`` feeds each question the media of the next one with
    as many images and videos (a question alone in its group keeps its own), ``no_image`` feeds none."""
    from neva.evaluate import correct_under_controls

    items = [("q0", []), ("q1", ["a"]), ("q2", ["b", "c"]), ("q3", ["d"]), ("q4", [], ["v1"]), ("q5", [], ["v2"])]
    answers = ["none", "a", "b", "d", "v1", "v2"]
    echo = MediaEcho()
    right = correct_under_controls(echo, items, answers, batch_size=4)
    assert right == {
        "image": [True] * 6,
        "swapped": [True, False, True, False, False, False],
        "no_image": [True, False, False, False, False, False],
    }
    swapped = echo.fed[6:12]
    assert [s[1:] for s in swapped] == [
        ([], []),
        (["d"], []),
        (["b", "c"], []),
        (["a"], []),
        ([], ["v2"]),
        ([], ["v1"]),
    ]
    assert [item[0] for item in echo.fed] == [f"q{i}" for i in range(6)] * 3  # the same prompts in every feed
