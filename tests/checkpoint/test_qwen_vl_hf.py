"""Qwen2-VL and Qwen2.5-VL against transformers' own classes (tiny random models written as hub directories):
import, neva's data path (LLaVA-format records → native front end → collate) equal to the HF processor's ids and
pixels, whole-model logits, packed rows equal to unpacked, greedy generation with the KV cache, export → reload."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from neva.checkpoint.hf_qwen_vl import export_qwen_vl, import_qwen_vl
from neva.checkpoint.neva_format import load_metadata, load_model, load_tokenizer
from neva.data.collate import collate_packed, collate_padded
from neva.data.conversation import Message, get_template
from neva.data.dataset import EncoderSettings, process_record
from neva.data.front_ends import front_end_for
from neva.data.images import FolderImageSource
from neva.data.tokens import image_token_for, tokenizer_image_token_id
from tests.checkpoint.tiny_hf import one_thread
from tests.checkpoint.tiny_qwen_vl import (
    MAX_PIXELS,
    MIN_PIXELS,
    hf_inputs,
    image_processor,
    tiny_qwen_vl_dir,
    write_image,
)
from tests.models.test_hf_parity import rel_err

SIZES = {"a.png": (70, 45), "b.png": (40, 100), "c.png": (150, 60)}  # (width, height): three aspect ratios
RECORDS = [
    {"id": "one", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A red circle."}]},
    {"id": "two", "image": ["b.png", "c.png"], "conversations": [
        {"from": "human", "value": "Compare <image> and <image> please."}, {"from": "gpt", "value": "Same colour."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(root / "images" / name, size, seed=i)
    with one_thread():
        hf_dir = tiny_qwen_vl_dir(root, request.param)
        ckpt = import_qwen_vl(hf_dir, root / "neva")
    return request.param, root, hf_dir, ckpt


def _samples(ckpt, root):
    model = load_model(ckpt).eval()
    tokenizer = load_tokenizer(ckpt)
    meta = load_metadata(ckpt)
    template = meta["conv_template"]
    settings = EncoderSettings(
        tokenizer=tokenizer,
        template=get_template(template, tokenizer),
        image_token_id=tokenizer_image_token_id(tokenizer, image_token_for(template)),
        num_image_tokens=0,
        max_length=512,
        image_token_placement="inline",
    )
    front_end = front_end_for(model.cfg.vision, model.cfg, "square", meta["min_pixels"], meta["max_pixels"])
    source = FolderImageSource(str(root / "images"))
    samples = [process_record(r, settings, source, front_end) for r in RECORDS]
    return model, tokenizer, settings, samples


def _hf_inputs(tokenizer, settings, record, root):
    from neva.data.conversation import parse_conversations

    text = settings.template.render(parse_conversations(record["conversations"])).text
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    images = [Image.open(root / "images" / n).convert("RGB") for n in names]
    return hf_inputs(tokenizer, image_processor(MIN_PIXELS, MAX_PIXELS), text, images)


def _logits(model, batch):
    return model(batch["input_ids"], batch["media"], batch["position_ids"], batch["segment_ids"])


def test_import_and_data_path_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    family, root, hf_dir, ckpt = imported
    meta = load_metadata(ckpt)
    assert (meta["min_pixels"], meta["max_pixels"], meta["conv_template"]) == (MIN_PIXELS, MAX_PIXELS, "qwen2_vl")
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            inputs = _hf_inputs(tokenizer, settings, record, root)
            # ids (image pads expanded by the grid), pixels and grids as the HF processor makes them
            assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            if "image_grid_thw" in inputs:
                assert torch.equal(sample["image_grid"], inputs["image_grid_thw"])
            batch = collate_padded([sample], pad_id=0, position_axes=3)
            with torch.no_grad():
                ours = _logits(model, batch)[0, : sample["input_ids"].numel()]
                theirs = hf(**inputs).logits[0]
            assert rel_err(ours, theirs) < 1e-5, (family, record["id"], rel_err(ours, theirs))


def test_packed_row_equals_each_sample_alone(imported):
    _, root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        packed = collate_packed(samples, pad_id=0, seq_length=512, position_axes=3)
        assert packed["input_ids"].shape[0] == 1  # one row holds all three
        with torch.no_grad():
            row = _logits(model, packed)[0]
            start = 0
            for sample in samples:
                n = sample["input_ids"].numel()
                alone = _logits(model, collate_padded([sample], pad_id=0, position_axes=3))[0, :n]
                assert rel_err(row[start : start + n], alone) < 1e-5
                start += n


def test_greedy_generation_equals_transformers(imported):
    from transformers import AutoModelForImageTextToText

    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    family, root, hf_dir, ckpt = imported
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6))
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        # a two-image prompt, a one-image prompt and a text-only one in one left-padded batch
        items = [("<image> then <image>: same?", [root / "images/b.png", root / "images/c.png"]),
                 ("<image>\nWhat is it?", [root / "images/a.png"]), ("Say hi.", [])]  # fmt: skip
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        text = answerer.builder.template.render_prompt
        for p, (prompt, paths), got in zip(prepared, items, ours):
            images = [Image.open(path).convert("RGB") for path in paths]
            rendered = text([Message("user", prompt)])
            inputs = hf_inputs(answerer.tokenizer, image_processor(MIN_PIXELS, MAX_PIXELS), rendered, images)
            assert inputs["input_ids"][0].tolist() == p.ids
            out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == out[0, len(p.ids) :].tolist(), family


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    family, root, hf_dir, ckpt = imported
    with one_thread():
        out = export_qwen_vl(ckpt, tmp_path / "export")
        assert json.loads((out / "config.json").read_text())["model_type"] == family
        a = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        b = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
        # the processor's parts (the processor class itself needs torchvision, not installed here)
        processor = AutoImageProcessor.from_pretrained(str(out))
        assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS)
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        image = Image.open(root / "images/c.png").convert("RGB")
        inputs = hf_inputs(tokenizer, processor, "<|vision_start|><|image_pad|><|vision_end|>hello", [image])
        with torch.no_grad():
            assert torch.equal(a(**inputs).logits, b(**inputs).logits)
