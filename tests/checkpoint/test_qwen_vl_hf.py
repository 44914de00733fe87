"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (DeepStack) and Qwen3-VL-MoE (stacked experts) against transformers' own classes (tiny random models written as hub directories):
import, neva's data path (LLaVA-format records → native front end → collate) equal to the HF processor's ids and
pixels, whole-model logits, packed rows equal to unpacked, greedy generation with the KV cache, export → reload."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from neva.checkpoint.hf_qwen_vl import export_qwen_vl, import_qwen_vl
from neva.checkpoint.neva_format import iter_tensors, load_metadata
from neva.data.collate import collate_packed, collate_padded
from neva.data.dataset import process_record
from neva.data.images import FolderImageSource
from neva.data.templates.base import Message
from tests.checkpoint.tiny_hf import one_thread
from tests.fixtures.data_path import checkpoint_data_path
from tests.fixtures.tiny_qwen_vl import (
    hf_inputs,
    image_processor,
    pixel_budget,
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


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(root / "images" / name, size, seed=i)
    with one_thread():
        hf_dir = tiny_qwen_vl_dir(root, request.param)
        ckpt = import_qwen_vl(hf_dir, root / "neva")
    return request.param, root, hf_dir, ckpt


def _samples(ckpt, root):
    model, tokenizer, settings, front_end = checkpoint_data_path(ckpt)
    source = FolderImageSource(str(root / "images"))
    samples = [process_record(r, settings, source, front_end) for r in RECORDS]
    return model, tokenizer, settings, samples


def _processor(family):
    return image_processor(*pixel_budget(family), model_type=family)


def _hf_inputs(tokenizer, settings, record, root, family):
    from neva.data.conversation import parse_conversations

    text = settings.template.render(parse_conversations(record["conversations"])).text
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    images = [Image.open(root / "images" / n).convert("RGB") for n in names]
    return hf_inputs(tokenizer, _processor(family), text, images)


def _logits(model, batch):
    return model(batch.input_ids, batch.media, batch.position_ids, batch.segment_ids)


def test_import_and_data_path_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    family, root, hf_dir, ckpt = imported
    meta = load_metadata(ckpt)
    template = "qwen3_vl" if family.startswith("qwen3") else "qwen2_vl"
    assert (meta["min_pixels"], meta["max_pixels"], meta["conv_template"]) == (*pixel_budget(family), template)
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            inputs = _hf_inputs(tokenizer, settings, record, root, family)
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
        assert packed.input_ids.shape[0] == 1  # one row holds all three
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
            inputs = hf_inputs(answerer.tokenizer, _processor(family), rendered, images)
            assert inputs["input_ids"][0].tolist() == p.ids
            out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == out[0, len(p.ids) :].tolist(), family


def test_raw_prompts_are_the_processors_ids(imported):
    """``neva.generate --raw``: an ``<image>`` tag is written as Qwen's vision block, a block given as it is stays one
    (issue 52: raw mode refused every Qwen-VL prompt); the ids are what the HF processor's parts give the text."""
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    family, root, _, ckpt = imported
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=1), raw=True)
    paths = [root / "images/a.png", root / "images/b.png"]
    images = [Image.open(path).convert("RGB") for path in paths]
    block = "<|vision_start|><|image_pad|><|vision_end|>"
    want = hf_inputs(answerer.tokenizer, _processor(family), f"{block}and {block}same?", images)["input_ids"]
    for prompt in ("<image>and <image>same?", f"{block}and <image>same?"):
        assert answerer.prepare((prompt, paths)).ids == want[0].tolist()
    with pytest.raises(ValueError, match="1 image placeholder"):
        answerer.prepare(("<image> only one", paths))


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    family, root, hf_dir, ckpt = imported
    with one_thread():
        out = export_qwen_vl(ckpt, tmp_path / "export")
        assert json.loads((out / "config.json").read_text())["model_type"] == family
        a = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        b = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
        # the processor's parts (the processor class itself needs torchvision, not installed here)
        processor = AutoImageProcessor.from_pretrained(str(out))
        assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == pixel_budget(family)
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        # transformers' generate stops where neva.generate does; the vision block's ids are the tokenizer's
        eos = GenerationConfig.from_pretrained(str(out)).eos_token_id
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
        assert b.config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
        assert b.config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
        image = Image.open(root / "images/c.png").convert("RGB")
        inputs = hf_inputs(tokenizer, processor, "<|vision_start|><|image_pad|><|vision_end|>hello", [image])
        with torch.no_grad():
            assert torch.equal(a(**inputs).logits, b(**inputs).logits)


def test_moe_experts_in_the_hub_layout_are_refused_with_the_way_through(imported, tmp_path):
    """The hub's Qwen3-VL-MoE files keep transformers 4.x's transposed experts (``gate_up_proj`` ``[E, H, 2I]``,
    ``down_proj`` ``[E, I, H]``): refused by name; transformers 5 loads them, and its save_pretrained imports."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from neva.typed import ConfigError

    family, _, hf_dir, ckpt = imported
    if family != "qwen3_vl_moe":
        pytest.skip("an MoE decoder's layout")
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    experts = [k for k in tensors if ".mlp.experts." in k]
    save_file({k: t.transpose(1, 2).contiguous() if k in experts else t for k, t in tensors.items()},
              str(hub / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"down_proj has the transformers 4\.x layout \[4, 24, 64\]"):
        import_qwen_vl(hub, tmp_path / "refused")
    with one_thread():
        resaved = tmp_path / "resaved"
        AutoModelForImageTextToText.from_pretrained(str(hub)).save_pretrained(str(resaved))
        for f in hub.iterdir():
            if not (resaved / f.name).exists():
                (resaved / f.name).write_bytes(f.read_bytes())
        again = import_qwen_vl(resaved, tmp_path / "again")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(iter_tensors(ckpt), iter_tensors(again)))


def test_an_hf_directory_is_imported_where_a_checkpoint_is_expected(imported, tmp_path):
    """``--checkpoint HF_DIR`` serves as the imported checkpoint does; ``model.restore_from_path=HF_DIR`` starts from
    one import under ``exp_dir``, recorded, and a rerun imports nothing (issue 52: refused without saying how)."""
    from neva.checkpoint.hf_start import IMPORTED_START, imported_start
    from neva.config import compose_config
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    family, root, hf_dir, ckpt = imported
    if family != "qwen2_5_vl":
        pytest.skip("one family: the import itself is tested above for each")
    item = ("<image>\nWhat is it?", [root / "images/a.png"])
    with one_thread():
        want = Answerer(ckpt, GenerationConfig(max_new_tokens=3)).answer([item])
        assert Answerer(hf_dir, GenerationConfig(max_new_tokens=3)).answer([item]) == want
        cfg = compose_config(
            ["+stage=finetune", f"model.restore_from_path={hf_dir}", f"exp_manager.exp_dir={tmp_path}"]
        )
        started = imported_start(cfg)
        out = tmp_path / IMPORTED_START
        assert started.model.restore_from_path == str(out)
        assert load_metadata(out)["source"]["path"] == str(hf_dir) and load_metadata(out)["conv_template"] == "qwen2_vl"
        written = (out / "config.json").stat().st_mtime_ns
        assert imported_start(cfg).model.restore_from_path == str(out)
        assert (out / "config.json").stat().st_mtime_ns == written


def test_preview_counts_each_images_positions_as_training(imported, tmp_path, capsys):
    """``neva.data.preview --tokenizer CKPT --json`` of a native-resolution checkpoint: the ids training encodes (each
    image its own positions at the recorded pixel budget; issue 52: refused, and 576 per image from the HF directory,
    which is now refused with the way through)."""
    from neva.data import preview
    from neva.errors import ConfigError

    family, root, hf_dir, ckpt = imported
    (tmp_path / "data.json").write_text(json.dumps(RECORDS))
    template = "qwen3_vl" if family.startswith("qwen3") else "qwen2_vl"
    args = [
        "--data-path",
        str(tmp_path / "data.json"),
        "--conv-template",
        template,
        "--image-token-placement",
        "inline",
    ]
    with one_thread():
        _, _, _, samples = _samples(ckpt, root)
        preview.main([*args, "--tokenizer", str(ckpt), "--image-folder", str(root / "images"), "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["input_ids"] for row in rows] == [sample["input_ids"].tolist() for sample in samples]
    assert [[i["tokens"] for i in row.get("images", [])] for row in rows] == [
        (s["image_grid"].prod(-1) // 4).tolist() if "image_grid" in s else [] for s in samples
    ]
    with pytest.raises(ConfigError, match="native-resolution"):
        preview.preview(preview.build_parser().parse_args([*args, "--tokenizer", str(hf_dir)]))


def test_lora_exports_as_base_and_peft_adapter(imported, tmp_path):
    """Every Qwen-VL family's LoRA as transformers + PEFT load it: the base export (its merger trained) with the
    adapter (LoRA layers, the mergers as ``modules_to_save``) gives the logits of the merged model's export (issue 52:
    ``--peft-adapter`` of a Qwen-VL run raised KeyError)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from neva.checkpoint.hf_qwen_vl import peft_names
    from neva.checkpoint.neva_format import load_model, save_checkpoint
    from neva.checkpoint.peft_adapter import save_peft_adapter
    from neva.models.lora import apply_lora, merged_state_dict, split_state_dict

    family, root, _, ckpt = imported
    with one_thread(), torch.no_grad():
        model = load_model(ckpt)
        torch.manual_seed(0)
        apply_lora(model, ["wq", "wv", "w2"], rank=4, alpha=8.0, dropout=0.0)
        for name, p in model.named_parameters():  # trained adapters and merger: not the identity
            if "lora_b" in name or name.startswith("projector."):
                p.add_(torch.randn_like(p) * 0.05)
        base, layers = split_state_dict(model)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        meta = {k: v for k, v in load_metadata(ckpt).items() if k != "dtype"}
        saved = {k: v for k, v in base.items() if k.startswith("projector.")}
        key, modules = peft_names(model.cfg)
        save_peft_adapter(tmp_path / "adapter", layers, {"projector": saved}, saved_key=key, saved_modules=modules)
        base_ckpt = save_checkpoint(tmp_path / "base", model.cfg, base, tokenizer, metadata=meta)
        merged_ckpt = save_checkpoint(
            tmp_path / "merged", model.cfg, merged_state_dict(model), tokenizer, metadata=meta
        )
        export_qwen_vl(base_ckpt, tmp_path / "base-hf")
        export_qwen_vl(merged_ckpt, tmp_path / "merged-hf")
        image = Image.open(root / "images/c.png").convert("RGB")
        inputs = hf_inputs(tokenizer, _processor(family), "<|vision_start|><|image_pad|><|vision_end|>hello", [image])
        adapted = PeftModel.from_pretrained(
            AutoModelForImageTextToText.from_pretrained(str(tmp_path / "base-hf")).eval(), str(tmp_path / "adapter")
        ).eval()
        want = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged-hf")).eval()(**inputs).logits
        torch.testing.assert_close(adapted(**inputs).logits, want, rtol=1e-4, atol=1e-4)
