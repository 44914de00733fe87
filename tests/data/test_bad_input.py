"""Every class of bad input is skipped, counted by reason and logged; config problems fail at start."""

from __future__ import annotations

import json
import logging
import os

import pytest

from neva.data.collate import collate_padded
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.dataset import ConversationDataset, EncoderSettings, is_skipped
from neva.data.front_ends import FixedImages
from neva.data.images import ImageProcessor, image_source_for
from neva.data.records import load_records
from neva.data.skips import DataQualityError, SkipTracker
from neva.data.templates.registry import get_template
from tests.data.conftest import qa, write_image, write_jsonl

BAD = {
    "missing_image": qa(image="nope.png", rid="missing"),
    "corrupt_image": qa(image="corrupt.png", rid="corrupt"),
    "image_count_mismatch": qa(image=["a.png", "a.png"], rid="mismatch"),
    "empty_conversation": {"id": "empty", "image": "a.png", "conversations": []},
    "unknown_role": {"id": "role", "conversations": [{"from": "bot", "value": "q"}, {"from": "gpt", "value": "a"}]},
    "unsafe_image_path": qa(image="../outside.png", rid="escape"),
    # over-long: the image span (in the second turn) would be cut → too_long; only the replies cut → no_learned_tokens
    "too_long": {
        "id": "long",
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "word " * 200},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "<image>\nQ"},
            {"from": "gpt", "value": "b"},
        ],
    },
    "no_learned_tokens": qa(q="<image>\n" + "word " * 200, rid="long_text"),
    # the image would sit inside the learned span: the model would learn to emit it
    "image_in_reply": qa(a="It is this one: <image>", rid="reply_image"),
}


@pytest.fixture
def bad_files(tmp_path):
    folder = tmp_path / "images"
    write_image(folder / "a.png")
    write_image(tmp_path / "outside.png")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    os.symlink(tmp_path / "outside.png", folder / "link.png")
    path = tmp_path / "data.jsonl"
    records = [
        qa(rid="good"),
        *BAD.values(),
        qa(image="/abs/a.png", rid="absolute"),
        qa(image="link.png", rid="symlink"),
    ]
    write_jsonl(path, records)
    with open(path, "ab") as f:
        f.write(b'{"id": "broken", "conversations": [\n')
        f.write(b'{"id": "latin1", "conversations": "\xe9\xe8"}\n')
    return str(path), str(folder)


def make_dataset(path, folder, tokenizer, vision, max_length=128):
    settings = EncoderSettings(tokenizer, get_template("vicuna_v1"), 4, vision.num_image_tokens, max_length)
    return ConversationDataset(
        load_records(path), settings, image_source_for(folder), FixedImages(ImageProcessor(vision))
    )


def test_each_bad_class_is_skipped_counted_and_logged(bad_files, synthetic_tokenizer, vision, caplog):
    path, folder = bad_files
    ds = make_dataset(path, folder, synthetic_tokenizer, vision)
    with caplog.at_level(logging.WARNING, logger="neva.data.dataset"):
        samples = [ds[i] for i in range(len(ds))]
    reasons = {s["id"]: s.get("skipped") for s in samples}
    assert reasons["good"] is None
    for reason, record in BAD.items():
        assert reasons[record["id"]] == reason, record["id"]
    assert reasons["absolute"] == reasons["symlink"] == "unsafe_image_path"
    n = len(BAD) + 4
    assert reasons[f"data.jsonl:{n}"] == "malformed_json"
    assert reasons[f"data.jsonl:{n + 1}"] == "invalid_utf8"
    assert "skipping sample missing: missing_image" in caplog.text
    batch = collate_padded(samples, pad_id=3)
    assert batch.counts.num_samples == 1
    assert sum(batch.counts.skipped.values()) == len(samples) - 1
    assert batch.counts.skipped["unsafe_image_path"] == 3


def test_good_sample_shapes(bad_files, synthetic_tokenizer, vision):
    path, folder = bad_files
    good = make_dataset(path, folder, synthetic_tokenizer, vision)[0]
    assert good["pixel_values"].shape == (1, 3, 32, 32)
    assert good["input_ids"].shape == good["labels"].shape
    assert (good["input_ids"] == 4).sum() == vision.num_image_tokens


def test_too_many_skips_stop_the_run(bad_files, synthetic_tokenizer, vision):
    path, folder = bad_files
    cfg = DataConfig(data_path=path, image_folder=folder, seq_length=128, skip_check_min_samples=4)
    dm = NevaDataModule(cfg, synthetic_tokenizer, vision=vision, micro_batch_size=4)
    with pytest.raises(DataQualityError, match="max_skip_fraction") as e:
        for _ in dm.train_dataloader():
            pass
    assert "by reason:" in str(e.value) and "preview --json" in str(e.value)


def test_config_errors_fail_at_start(tmp_path):
    with pytest.raises(ValueError, match="conv_template"):
        DataConfig(conv_template="vicuna")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DataConfig(data_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="concat_sampling_probabilities"):
        DataConfig(data_path=["synthetic", "synthetic"], concat_sampling_probabilities=[0.5])
    with pytest.raises(ValueError, match="image_aspect_ratio"):
        DataConfig(image_aspect_ratio="stretch")


def test_image_token_id_must_match_model(synthetic_tokenizer):
    from neva.models.presets import build_config

    with pytest.raises(ValueError, match="image_token_id"):
        NevaDataModule(DataConfig(), synthetic_tokenizer, build_config())


def test_truncation_is_counted_not_skipped(tmp_path, synthetic_tokenizer, vision):
    """An over-long sample is cut to the maximum length and trained on; the cut is counted (metrics, resume)."""
    write_image(tmp_path / "images" / "a.png")
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [qa(rid="short"), qa(a="A red circle. " * 40, rid="long")])
    ds = make_dataset(str(path), str(tmp_path / "images"), synthetic_tokenizer, vision, max_length=320)
    short, long = ds[0], ds[1]
    assert not short["truncated"] and long["truncated"] and not is_skipped(long)
    assert long["input_ids"].numel() == 320
    batch = collate_padded([short, long], pad_id=3)
    assert batch.counts.truncated == 1 and batch.counts.num_samples == 2 and batch.counts.skipped == {}
    tracker = SkipTracker()
    tracker.update(batch.counts)
    assert tracker.metrics()["data/truncated"] == 1 and tracker.fraction == 0
    resumed = SkipTracker()
    resumed.load_state_dict(tracker.state_dict())
    assert resumed.truncated == 1


def test_top_level_json_object_is_an_error_naming_the_file(tmp_path):
    """A JSON object (pretty-printed or on one line) is not one record; a one-record JSONL file still is."""
    rec = qa(rid="one")
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps({"data": [rec], "info": "x"}, indent=2))
    with pytest.raises(ValueError, match="the top level is an object") as e:
        load_records(str(pretty))
    assert str(pretty) in str(e.value) and "'data', 'info'" in str(e.value) and "expected a JSON list" in str(e.value)
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=r"must be named \.jsonl"):
        load_records(str(one_line))
    scalar = tmp_path / "scalar.json"
    scalar.write_text('"records.json"')
    with pytest.raises(ValueError, match="the top level is a str"):
        load_records(str(scalar))
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text(json.dumps(rec) + "\n")
    assert [r["id"] for r in load_records(str(jsonl))] == ["one"]


def test_leading_reply_is_dropped_and_counted(tmp_path, synthetic_tokenizer, vision):
    """A conversation that opens with a gpt turn loses that turn (LLaVA's ``preprocess``: ``source = source[1:]``)
    and is trained on as the rest; the drop is counted like a truncation (metrics, resume), not skipped."""
    write_image(tmp_path / "images" / "a.png")
    path = tmp_path / "data.jsonl"
    plain = qa(rid="plain")
    led = {**plain, "id": "led", "conversations": [{"from": "gpt", "value": "Hello!"}, *plain["conversations"]]}
    write_jsonl(path, [plain, led])
    ds = make_dataset(str(path), str(tmp_path / "images"), synthetic_tokenizer, vision)
    kept, dropped = ds[0], ds[1]
    assert not is_skipped(dropped) and dropped["dropped_leading_reply"] and not kept["dropped_leading_reply"]
    assert dropped["input_ids"].tolist() == kept["input_ids"].tolist()
    assert dropped["labels"].tolist() == kept["labels"].tolist()
    batch = collate_padded([kept, dropped], pad_id=3)
    assert batch.counts.dropped_leading_reply == 1 and batch.counts.skipped == {}
    tracker = SkipTracker()
    tracker.update(batch.counts)
    assert tracker.metrics()["data/dropped_leading_reply"] == 1 and tracker.fraction == 0
    resumed = SkipTracker()
    resumed.load_state_dict(tracker.state_dict())
    assert resumed.dropped_leading_reply == 1
