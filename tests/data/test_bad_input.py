"""Every class of bad input is skipped, counted by reason and logged; config problems fail at start."""

from __future__ import annotations

import logging
import os

import pytest

from neva.data.collate import collate_padded
from neva.data.config import DataConfig
from neva.data.conversation import get_template
from neva.data.datamodule import NevaDataModule
from neva.data.dataset import ConversationDataset, EncoderSettings
from neva.data.images import ImageProcessor, image_source_for
from neva.data.records import load_records
from neva.data.skips import DataQualityError
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
    return ConversationDataset(load_records(path), settings, image_source_for(folder), ImageProcessor(vision))


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
    assert reasons["data.jsonl:12"] == "malformed_json"
    assert reasons["data.jsonl:13"] == "invalid_utf8"
    assert "skipping sample missing: missing_image" in caplog.text
    batch = collate_padded(samples, pad_id=3)
    assert batch["num_samples"] == 1
    assert sum(batch["skipped"].values()) == len(samples) - 1
    assert batch["skipped"]["unsafe_image_path"] == 3


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
