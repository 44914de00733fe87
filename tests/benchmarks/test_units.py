"""Every benchmark names the unit of each score it reports, and the table prints each as papers do."""

from neva.benchmarks.table import BENCHMARKS, UNITS
from neva.evaluate import table_lines


def test_every_benchmark_names_a_known_unit():
    for name, bench in BENCHMARKS.items():
        assert {bench.unit, *(u for _, u in bench.unit_of)} <= set(UNITS), name


def test_units_of_a_result_and_the_table_line():
    gqa, ocr = BENCHMARKS["gqa"], BENCHMARKS["ocrbench"]
    scores = {"accuracy": 61.5, "binary": 80.0, "distribution": 0.0123, "n": 12, "per_type": {"x": 1.0}}
    assert gqa.units(scores) == {"accuracy": "percent", "binary": "percent", "distribution": "chi-square / 100"}
    ocr_scores = {"final_score": 806, "accuracy": 0.806, "accuracy_stderr": 0.0125, "text_recognition": 200, "n": 1000}
    assert ocr.units(ocr_scores) == {"final_score": "points of 1000", "accuracy": "fraction"}
    rows = [{"suite": "gqa", **scores, "units": gqa.units(scores), "questions": 12, "skipped": 0},
            {"suite": "ocrbench", **ocr_scores, "units": ocr.units(ocr_scores), "questions": 1000, "skipped": 1},
            {"suite": "mme", "perception": 1510.75, "cognition": 300.0, "units": {"perception": "points",
             "cognition": "points"}, "questions": 4, "skipped": 0}]  # fmt: skip
    assert table_lines(rows) == [
        "gqa                  accuracy 61.50%  binary 80.00%  distribution 0.0123 (chi-square / 100)  "
        "questions 12 skipped 0",
        "ocrbench             final_score 806/1000  accuracy 80.60% ± 1.25  questions 1000 skipped 1",
        "mme                  perception 1510.8 points  cognition 300.0 points  questions 4 skipped 0",
    ]
