"""InternVL 3 / 3.5 against transformers' own ``InternVLForConditionalGeneration`` (tiny random models written as hub
directories; two variants: InternViT-300M's blocks with a Qwen2 decoder, InternViT-6B's RMSNorm and q / k norms with
a Qwen3 decoder): import and export through `neva.convert` (the family's Interop), neva's data path (LLaVA-format records → tiles → collate) equal to the processor's ids and
pixels, whole-model logits on images of several sizes (1, 7 and 11 tiles), two images and text only, packed rows
equal to unpacked, greedy generation on a left-padded batch, export → reload."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from neva.checkpoint.neva_format import load_metadata
from neva.convert import main as convert_main
from neva.data.collate import collate_packed, collate_padded
from neva.data.conversation import parse_conversations
from neva.data.dataset import process_record
from neva.data.images import FolderImageSource
from neva.data.templates.base import Message
from neva.models.vision import normalize_pixels
from tests.checkpoint.tiny_hf import one_thread
from tests.checkpoint.tiny_internvl import MEAN, STD, hf_inputs, tiny_internvl_dir
from tests.fixtures.data_path import checkpoint_data_path
from tests.fixtures.tiny_qwen_vl import write_image
from tests.models.test_hf_parity import rel_err

# (width, height) → tiles of 28 px: 3×2 + thumbnail, 2×5 + thumbnail, 5×2 + thumbnail, one tile without a thumbnail
SIZES = {"a.png": (70, 45), "b.png": (40, 100), "c.png": (150, 60), "d.png": (20, 20)}
TILES = {"a.png": 7, "b.png": 11, "c.png": 11, "d.png": 1}
RECORDS = [
    {"id": "one", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A red circle."}]},
    {"id": "two", "image": ["b.png", "d.png"], "conversations": [
        {"from": "human", "value": "Compare <image> and <image> please."}, {"from": "gpt", "value": "Same colour."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
    {"id": "wide", "image": "c.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Wide."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["internvl3", "internvl3_qk"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(root / "images" / name, size, seed=i)
    with one_thread():
        hf_dir = tiny_internvl_dir(root, request.param)
        convert_main(["hf-to-neva", "--hf", str(hf_dir), "--out", str(root / "neva")])  # through the family's Interop
    return request.param, root, hf_dir, root / "neva"


def _samples(ckpt, root):
    model, tokenizer, settings, front_end = checkpoint_data_path(ckpt, max_length=1024)
    source = FolderImageSource(str(root / "images"))
    samples = [process_record(r, settings, source, front_end) for r in RECORDS]
    for record, sample in zip(RECORDS, samples):  # the length estimate from image headers: the positions encoded
        assert front_end.record_tokens(record, source) == sample["image_positions"].numel(), record["id"]
    return model, tokenizer, settings, samples


def _images(root, record):
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    return names, [Image.open(root / "images" / n).convert("RGB") for n in names]


def _logits(model, batch):
    return model(batch.input_ids, batch.media, batch.position_ids, batch.segment_ids)


def test_import_and_data_path_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    _, root, hf_dir, ckpt = imported
    assert load_metadata(ckpt)["conv_template"] == "internvl"
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            names, images = _images(root, record)
            # transformers' chat template writes an image as <IMG_CONTEXT>, which the processor expands
            text = settings.template.render(parse_conversations(record["conversations"])).text
            inputs = hf_inputs(tokenizer, text.replace("<img><IMG_CONTEXT></img>", "<IMG_CONTEXT>"), images)
            assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            assert sample["pixel_values"].shape[0] == sum(TILES[n] for n in names)
            if images:  # uint8 tiles, normalised by the tower: the processor's pixels
                ours = normalize_pixels(sample["pixel_values"], tuple(MEAN), tuple(STD))
                assert (ours - inputs["pixel_values"]).abs().max() < 1e-5
            batch = collate_padded([sample], pad_id=0)
            with torch.no_grad():
                ours = _logits(model, batch)[0, : sample["input_ids"].numel()]
                theirs = hf(**inputs).logits[0]
            assert rel_err(ours, theirs) < 1e-5, (record["id"], rel_err(ours, theirs))


def test_packed_row_equals_each_sample_alone(imported):
    _, root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        packed = collate_packed(samples, pad_id=0, seq_length=1024)
        assert packed.input_ids.shape[0] == 1  # one row holds them all
        with torch.no_grad():
            row = _logits(model, packed)[0]
            start = 0
            for sample in samples:
                n = sample["input_ids"].numel()
                alone = _logits(model, collate_padded([sample], pad_id=0))[0, :n]
                assert rel_err(row[start : start + n], alone) < 1e-5
                start += n


def test_greedy_generation_equals_transformers(imported):
    from transformers import AutoModelForImageTextToText

    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    _, root, hf_dir, ckpt = imported
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6))
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        # a two-image prompt, a one-image prompt and a text-only one in one left-padded batch
        items = [("<image> then <image>: same?", [root / "images/b.png", root / "images/d.png"]),
                 ("<image>\nWhat is it?", [root / "images/a.png"]), ("Say hi.", [])]  # fmt: skip
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        render = answerer.builder.template.render_prompt
        rows, pixels = [], []
        for p, (prompt, paths) in zip(prepared, items):
            images = [Image.open(path).convert("RGB") for path in paths]
            text = render([Message("user", prompt)]).replace("<img><IMG_CONTEXT></img>", "<IMG_CONTEXT>")
            inputs = hf_inputs(answerer.tokenizer, text, images)
            assert inputs["input_ids"][0].tolist() == p.ids
            rows.append(p.ids)
            pixels += [inputs["pixel_values"]] if images else []
        # transformers on the same left-padded batch (InternVLProcessor's padding side)
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pixels), max_new_tokens=6,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert ours == out[:, width:].tolist()
        # --raw: the prompt as given, each <image> tag written as the processor writes an image (<img>…</img>)
        raw = Answerer(ckpt, GenerationConfig(max_new_tokens=6), raw=True)
        raw.generation = answerer.generation
        text = "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
        prepared = raw.prepare((text, [root / "images/a.png"]))
        inputs = hf_inputs(raw.tokenizer, text.replace("<image>", "<IMG_CONTEXT>"), [Image.open(root / "images/a.png")])
        assert prepared.ids == inputs["input_ids"][0].tolist()
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert raw.generate_ids([prepared]) == [out[0, len(prepared.ids) :].tolist()]


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    variant, root, hf_dir, ckpt = imported
    with one_thread():
        convert_main(["neva-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "export")])
        out = tmp_path / "export"
        assert json.loads((out / "config.json").read_text())["model_type"] == "internvl"
        a = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        b = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
        # the processor's parts (InternVLProcessor itself needs torchvision, not installed here)
        processor = AutoImageProcessor.from_pretrained(str(out))
        assert processor.crop_to_patches and processor.max_patches == 12
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        assert tokenizer.context_image_token == "<IMG_CONTEXT>" and tokenizer.start_image_token == "<img>"
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello"}]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == "<|im_start|>user\n<IMG_CONTEXT>\nhello<|im_end|>\n<|im_start|>assistant\n"
        image = Image.open(root / "images/a.png").convert("RGB")
        inputs = hf_inputs(tokenizer, text, [image])
        with torch.no_grad():
            assert torch.equal(a(**inputs).logits, b(**inputs).logits), variant


def test_fields_neva_does_not_build_are_refused_by_name(imported):
    from neva.checkpoint.hf_internvl import neva_config_from_internvl
    from neva.typed import ConfigError

    _, _, hf_dir, _ = imported
    hf = json.loads((hf_dir / "config.json").read_text())
    neva_config_from_internvl(hf)  # as written: read
    bad = dict(hf, downsample_ratio=0.25, vision_config=dict(hf["vision_config"], use_mean_pooling=False, foo=1))
    with pytest.raises(ConfigError, match=r"downsample_ratio=0\.25"):
        neva_config_from_internvl(bad)
    with pytest.raises(ConfigError, match=r"use_mean_pooling=False .*; foo=1 \(unknown to neva"):
        neva_config_from_internvl(dict(bad, downsample_ratio=0.5))


def test_tile_counts_and_the_planners_image_load_are_the_processors():
    """neva's tile rule (data path, serving and planner alike) = ``get_number_of_image_patches`` of the processor,
    over sizes that cross the rule's ties (square images of growing area, exact and near aspect ratios)."""
    from neva.data.internvl_tiles import tile_count
    from neva.models.presets import build_config
    from neva.planner.images import image_load
    from tests.checkpoint.tiny_internvl import TILE, image_processor

    processor = image_processor()
    sizes = [(h, w) for h in (10, 28, 40, 56, 90, 150, 300) for w in (10, 28, 45, 70, 100, 160, 400)]
    for h, w in sizes:
        theirs = processor.get_number_of_image_patches(h, w, {"crop_to_patches": True})
        assert tile_count(h, w, TILE) == theirs, (h, w)
    cfg = build_config(llm="tiny_qwen2", vision="tiny_internvl", projector_type="mlp_pixel_shuffle")
    load = image_load(cfg, (64, 160))  # 32 px tiles: 5 × 2 and the thumbnail
    assert (load.tiles, load.tokens) == (11, 11 * cfg.num_image_tokens) and image_load(cfg).tiles == 13


def test_module_name_layout_imports_the_same_tensors(imported, tmp_path):
    """transformers 5's module names (``model.vision_tower.``, ``model.multi_modal_projector.``,
    ``model.language_model.``, ``lm_head.weight``) import as the ``save_pretrained`` layout does."""
    from safetensors.torch import load_file, save_file

    from neva.checkpoint.hf_internvl import INTERNVL_INTEROP
    from neva.checkpoint.neva_format import iter_tensors

    _, _, hf_dir, ckpt = imported
    renamed = tmp_path / "modules"
    renamed.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    names = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
             "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}  # fmt: skip
    tensors = load_file(str(hf_dir / "model.safetensors"))
    moved = {
        next(new + k[len(old) :] for old, new in names.items() if k.startswith(old)): t for k, t in tensors.items()
    }
    save_file(moved, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    again = INTERNVL_INTEROP.import_dir(renamed, tmp_path / "again")
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(iter_tensors(ckpt), iter_tensors(again)))
