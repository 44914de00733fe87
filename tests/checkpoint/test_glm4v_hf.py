"""GLM-4.1V against transformers' own classes (a tiny random ``Glm4vForConditionalGeneration`` written as a hub
directory): import through ``neva.convert``, neva's data path (LLaVA-format records → native front end → collate)
equal to the HF processor's ids, pixels and grids, whole-model logits on images of several sizes (one under a merged
token's side), two images and text only, packed rows equal to unpacked, greedy generation on a left-padded batch
(template and raw prompts), export → reload with identical logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from neva.checkpoint.neva_format import load_metadata
from neva.data.collate import collate_packed, collate_padded
from neva.data.conversation import Message, parse_conversations
from neva.data.dataset import process_record
from neva.data.images import FolderImageSource
from tests.checkpoint.tiny_glm4v import MAX_PIXELS, MIN_PIXELS, hf_inputs, image_processor, tiny_glm4v_dir
from tests.checkpoint.tiny_hf import one_thread
from tests.checkpoint.tiny_qwen_vl import checkpoint_data_path, write_image
from tests.models.test_hf_parity import rel_err

# (width, height): three aspect ratios, and one side under 28 px (the processor scales it up first)
SIZES = {"a.png": (70, 45), "b.png": (40, 100), "c.png": (150, 60), "d.png": (20, 60)}
RECORDS = [
    {"id": "one", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A red circle."}]},
    {"id": "two", "image": ["b.png", "c.png"], "conversations": [
        {"from": "human", "value": "Compare <image> and <image> please."}, {"from": "gpt", "value": "Same colour."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
    {"id": "small", "image": "d.png", "conversations": [
        {"from": "human", "value": "<image> Thin?"}, {"from": "gpt", "value": "Very."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from neva import convert

    root = tmp_path_factory.mktemp("glm4v")
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(root / "images" / name, size, seed=i)
    with one_thread():
        hf_dir = tiny_glm4v_dir(root)
        convert.main(["hf-to-neva", "--hf", str(hf_dir), "--out", str(root / "neva")])
    return root, hf_dir, root / "neva"


def _samples(ckpt, root):
    model, tokenizer, settings, front_end = checkpoint_data_path(ckpt)
    source = FolderImageSource(str(root / "images"))
    return model, tokenizer, settings, [process_record(r, settings, source, front_end) for r in RECORDS]


def _hf_inputs(tokenizer, settings, record, root):
    text = settings.template.render(parse_conversations(record["conversations"])).text
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    images = [Image.open(root / "images" / n).convert("RGB") for n in names]
    return hf_inputs(tokenizer, image_processor(), text, images)


def _logits(model, batch):
    return model(batch["input_ids"], batch["media"], batch["position_ids"], batch["segment_ids"])


def test_import_and_data_path_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    root, hf_dir, ckpt = imported
    meta = load_metadata(ckpt)
    assert (meta["min_pixels"], meta["max_pixels"], meta["conv_template"]) == (MIN_PIXELS, MAX_PIXELS, "glm4v")
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            inputs = _hf_inputs(tokenizer, settings, record, root)
            # ids (each <|image|> expanded by the grid), pixels and grids as the HF processor makes them
            assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            if "image_grid_thw" in inputs:
                assert torch.equal(sample["image_grid"], inputs["image_grid_thw"])
                mean = torch.tensor(model.cfg.vision.image_mean).repeat_interleave(2 * 14 * 14)
                std = torch.tensor(model.cfg.vision.image_std).repeat_interleave(2 * 14 * 14)
                ours = (sample["pixel_values"].float() / 255 - mean) / std
                assert torch.allclose(ours, inputs["pixel_values"], atol=1e-5), record["id"]
            batch = collate_padded([sample], pad_id=0, position_axes=3)
            with torch.no_grad():
                ours = _logits(model, batch)[0, : sample["input_ids"].numel()]
                theirs = hf(**inputs).logits[0]
            assert rel_err(ours, theirs) < 1e-5, (record["id"], rel_err(ours, theirs))
