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
from neva.data.conversation import parse_conversations
from neva.data.dataset import process_record
from neva.data.images import FolderImageSource
from neva.data.templates.base import Message
from tests.checkpoint.tiny_glm4v import MAX_PIXELS, MIN_PIXELS, hf_inputs, image_processor, tiny_glm4v_dir
from tests.checkpoint.tiny_hf import one_thread
from tests.fixtures.data_path import checkpoint_data_path
from tests.fixtures.tiny_qwen_vl import write_image
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
    return model(batch.input_ids, batch.media, batch.position_ids, batch.segment_ids)


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


def test_packed_row_equals_each_sample_alone(imported):
    root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        packed = collate_packed(samples, pad_id=0, seq_length=512, position_axes=3)
        assert packed.input_ids.shape[0] == 1  # one row holds all four
        with torch.no_grad():
            row = _logits(model, packed)[0]
            start = 0
            for sample in samples:
                n = sample["input_ids"].numel()
                alone = _logits(model, collate_padded([sample], pad_id=0, position_axes=3))[0, :n]
                assert rel_err(row[start : start + n], alone) < 1e-5
                start += n


ITEMS = [("<image> then <image>: same?", ["b.png", "c.png"]), ("<image>\nWhat is it?", ["a.png"]), ("Say hi.", [])]


def test_greedy_generation_equals_transformers(imported):
    """A two-image prompt, a one-image prompt and a text-only one in one left-padded batch (neva.generate's
    template mode) against transformers' generate on each prompt alone."""
    from transformers import AutoModelForImageTextToText

    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    root, hf_dir, ckpt = imported
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6))
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        items = [(prompt, [root / "images" / n for n in names]) for prompt, names in ITEMS]
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        assert len({len(p.ids) for p in prepared}) == 3  # the batch is left-padded
        for p, (prompt, paths), got in zip(prepared, items, ours):
            images = [Image.open(path).convert("RGB") for path in paths]
            rendered = answerer.builder.template.render_prompt([Message("user", prompt)])
            assert rendered.startswith("[gMASK]<sop><|user|>\n") and rendered.endswith("<|assistant|>\n")
            inputs = hf_inputs(answerer.tokenizer, image_processor(), rendered, images)
            assert inputs["input_ids"][0].tolist() == p.ids
            out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == out[0, len(p.ids) :].tolist(), prompt


def test_raw_prompts_are_the_processors_ids_and_generate_as_transformers(imported):
    """``neva.generate --raw``: an ``<image>`` tag is written as GLM's image block; the ids are what the HF
    processor's parts give the text, and the greedy tokens transformers'. A block written out in the prompt is not
    read as an image (only Qwen-VL's are): refused in one line by its tag count."""
    from transformers import AutoModelForImageTextToText

    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    root, hf_dir, ckpt = imported
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=4), raw=True)
    answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
    paths = [root / "images/a.png", root / "images/b.png"]
    images = [Image.open(path).convert("RGB") for path in paths]
    block = "<|begin_of_image|><|image|><|end_of_image|>"
    want = hf_inputs(answerer.tokenizer, image_processor(), f"{block}and {block}same?", images)
    assert answerer.prepare(("<image>and <image>same?", paths)).ids == want["input_ids"][0].tolist()
    for prompt in ("<image> only one", f"{block}and <image>same?"):
        with pytest.raises(ValueError, match="prompt has 1 <image> tag"):
            answerer.prepare((prompt, paths))
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        prepared = [answerer.prepare(("<image>and <image>same?", paths)), answerer.prepare(("hello", []))]
        ours = answerer.generate_ids(prepared)
        image_inputs = dict(image_processor()(images=images, return_tensors="pt"))
        for p, got, extra in zip(prepared, ours, (image_inputs, {})):
            ids = torch.tensor([p.ids])
            kinds = (ids == answerer.tokenizer.convert_tokens_to_ids("<|image|>")).long()
            inputs = {"input_ids": ids, "mm_token_type_ids": kinds, **extra}
            out = hf.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == out[0, len(p.ids) :].tolist()


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    from neva import convert

    root, hf_dir, ckpt = imported
    out = tmp_path / "export"
    with one_thread():
        convert.main(["neva-to-hf", "--ckpt", str(ckpt), "--out", str(out)])
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "glm4v"
        a = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        b = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
        processor = AutoImageProcessor.from_pretrained(str(out))
        assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS)
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        eos = GenerationConfig.from_pretrained(str(out)).eos_token_id
        assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in (eos if isinstance(eos, list) else [eos])
        for field in ("image_start_token_id", "image_end_token_id", "video_token_id"):
            assert getattr(b.config, field) == getattr(a.config, field)
        # every tensor as the source wrote it (the q / k rows back in GLM's interleaved order, gate_up fused)
        want, got = a.state_dict(), b.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        # the exported chat template renders what neva trained on
        from neva.data.templates.registry import get_template

        turns = [("user", "<image>\nHi"), ("assistant", "Yo."), ("user", "And <image>?"), ("assistant", "No.")]
        rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False)
        assert rendered == get_template("glm4v").render([Message(r, c) for r, c in turns]).text
        assert rendered.startswith("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>\nHi")
        image = Image.open(root / "images/c.png").convert("RGB")
        inputs = hf_inputs(tokenizer, processor, "<|begin_of_image|><|image|><|end_of_image|>hello", [image])
        with torch.no_grad():
            assert torch.equal(a(**inputs).logits, b(**inputs).logits)


def test_glm45v_and_unread_fields_are_refused_by_name(imported, tmp_path):
    from neva.checkpoint.hf_glm4v import neva_config_from_glm4v
    from neva.typed import ConfigError

    _, hf_dir, _ = imported
    hf = json.loads((hf_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"glm4v_moe.*not supported yet"):
        neva_config_from_glm4v({**hf, "model_type": "glm4v_moe"})
    with pytest.raises(ConfigError, match="'frobnicate' is not read"):
        neva_config_from_glm4v({**hf, "vision_config": {**hf["vision_config"], "frobnicate": 1}})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        neva_config_from_glm4v({**hf, "text_config": {**hf["text_config"], "hidden_act": "gelu"}})
