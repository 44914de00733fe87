"""Gemma 3 against transformers' own ``Gemma3ForConditionalGeneration`` (a tiny random model written as a hub
directory, ``tests/checkpoint/tiny_gemma3.py``): import, whole-model logits (images of several sizes through the
family's image processor, two images, text only; sliding and global layers, bidirectional attention inside each
image), neva's data path (LLaVA-format records → gemma3 template → encoding → collate) equal to ``Gemma3Processor``
on the official chat template's text, packed rows equal to each sample alone, export → reload."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from neva.checkpoint.hf_gemma3 import GEMMA3_INTEROP
from neva.checkpoint.neva_format import load_model
from neva.models.media import Media, MediaInputs, image_media
from tests.checkpoint.tiny_gemma3 import (
    BOI,
    EOI,
    IMAGE,
    TOKENS_PER_IMAGE,
    hf_messages,
    make_processor,
    tiny_gemma3_dir,
)
from tests.checkpoint.tiny_hf import one_thread
from tests.fixtures.data_path import checkpoint_data_path
from tests.models.test_hf_parity import rel_err

SIZES = [(70, 45), (40, 100), (150, 60)]  # (width, height): three aspect ratios, all resized to 28 × 28
RECORDS = [
    {"id": "one", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat is it?"}, {"from": "gpt", "value": "a red circle."}]},
    {"id": "two", "image": ["b.png", "c.png"], "conversations": [
        {"from": "human", "value": "compare <image> and <image> please."}, {"from": "gpt", "value": "same colour."},
        {"from": "human", "value": "sure?"}, {"from": "gpt", "value": "yes."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "say hi."}, {"from": "gpt", "value": "hi."}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for name, (w, h) in zip(("a.png", "b.png", "c.png"), SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / name)
    with one_thread():
        hf, hf_dir = tiny_gemma3_dir(root)
        ckpt = GEMMA3_INTEROP.import_dir(hf_dir, root / "neva")
        model = load_model(ckpt).eval()
    return hf, hf_dir, ckpt, model, root


def _pixels(sizes) -> torch.Tensor:
    """The family's image processor's pixels of random images of ``sizes``."""
    from transformers import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return processor(images, return_tensors="pt")["pixel_values"]


def _prompt(n_images: int, text_len: int, seed: int) -> torch.Tensor:
    """Text, then per image ``<start_of_image>`` + its tokens + ``<end_of_image>`` and text: longer than the window."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, BOI, (3,), generator=g)]
    for _ in range(n_images):
        parts += [torch.tensor([BOI]), torch.full((TOKENS_PER_IMAGE,), IMAGE), torch.tensor([EOI])]
        parts.append(torch.randint(3, BOI, (2,), generator=g))
    parts.append(torch.randint(3, BOI, (text_len,), generator=g))
    return torch.cat(parts)


CASES = [(1, [SIZES[0]]), (2, SIZES[1:]), (0, [])]  # one image, two images of other sizes, text only


def _hf_logits(hf, ids, pixels):
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits


def test_logits_equal_transformers(imported):
    hf, _, _, model, _ = imported
    with one_thread():
        for seed, (n, sizes) in enumerate(CASES):
            ids = _prompt(n, 7, seed)[None]
            pixels = _pixels(sizes) if n else None
            with torch.no_grad():
                ours = model(ids, image_media(pixels) if n else None)
            assert rel_err(ours, _hf_logits(hf, ids, pixels)) < 1e-5, (n, rel_err(ours, _hf_logits(hf, ids, pixels)))
            if n:  # the bidirectional blocks matter: causal attention inside the images is another model
                with torch.no_grad():
                    causal = hf(input_ids=ids, pixel_values=pixels).logits
                assert rel_err(ours, causal) > 1e-2


def test_data_path_equals_gemma3_processor(imported):
    """ids (the chat template's text, each image expanded as the processor does), pixels (bilinear, 0.5 / 0.5) and
    the logits of the collated sample equal ``Gemma3Processor``'s and the model's on them."""
    from neva.data.collate import collate_padded
    from neva.data.dataset import process_record
    from neva.data.images import FolderImageSource
    from neva.models.vision import normalize_pixels

    hf, _, ckpt, _, root = imported
    with one_thread():
        model, tokenizer, settings, front_end = checkpoint_data_path(ckpt)
        settings = dataclasses.replace(settings, num_image_tokens=model.cfg.num_image_tokens)  # its fixed count
        processor = make_processor(tokenizer)
        source = FolderImageSource(str(root / "images"))
        for record in RECORDS:
            sample = process_record(record, settings, source, front_end)
            assert "skipped" not in sample, sample
            text = processor.apply_chat_template(hf_messages(record), tokenize=False)
            names = record.get("image", [])
            images = [Image.open(root / "images" / n) for n in ([names] if isinstance(names, str) else names)]
            # the template writes BOS itself (apply_chat_template tokenizes without special tokens too)
            inputs = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
            assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist(), record["id"]
            assert (sample["input_ids"] == IMAGE).sum() == TOKENS_PER_IMAGE * len(images)
            if images:
                got = normalize_pixels(sample["pixel_values"], (0.5,) * 3, (0.5,) * 3)
                assert (got - inputs["pixel_values"]).abs().max() < 1e-6
            batch = collate_padded([sample], pad_id=0)
            n = sample["input_ids"].numel()
            with torch.no_grad():
                ours = model(batch.input_ids, batch.media, batch.position_ids)[0, :n]
                theirs = hf(**inputs).logits[0]
            assert rel_err(ours, theirs) < 1e-5, record["id"]


def test_packed_row_equals_each_sample_alone(imported):
    """Three samples in one packed row (positions restart, segments isolate; the collator's image positions):
    each equals transformers' logits of the sample alone."""
    hf, _, _, model, _ = imported
    prompts = [_prompt(n, 7, seed) for seed, (n, _) in enumerate(CASES)]
    pixels = _pixels(SIZES)
    ids = torch.cat(prompts)[None]
    segments = torch.cat([torch.full((len(p),), i + 1) for i, p in enumerate(prompts)])[None]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    image_at = (ids[0] == IMAGE).nonzero().flatten()
    media = Media(image=MediaInputs(pixels, positions=torch.stack([torch.zeros_like(image_at), image_at], 1)))
    with one_thread(), torch.no_grad():
        row = model(ids, media, position_ids=positions, segment_ids=segments)[0]
        start, used = 0, 0
        for (n, _), prompt in zip(CASES, prompts):
            expected = _hf_logits(hf, prompt[None], pixels[used : used + n] if n else None)[0]
            assert rel_err(row[start : start + len(prompt)], expected) < 1e-5
            start, used = start + len(prompt), used + n


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    """``neva.convert neva-to-hf``: weights and config transformers loads as the same model, and the processor's files
    (``AutoProcessor`` gives the same ids and pixels as the source's processor); ``hf-to-neva`` of the export is the
    same checkpoint."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from neva.convert import main

    hf, hf_dir, ckpt, _, root = imported
    out = tmp_path / "export"
    with one_thread():
        main(["neva-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--dtype", "float32"])
        assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"
        reloaded = Gemma3ForConditionalGeneration.from_pretrained(str(out)).eval()
        ids, pixels = _prompt(2, 5, 7)[None], _pixels(SIZES[:2])
        assert torch.equal(_hf_logits(reloaded, ids, pixels), _hf_logits(hf, ids, pixels))
        exported, source = AutoProcessor.from_pretrained(str(out)), AutoProcessor.from_pretrained(str(hf_dir))
        messages = hf_messages(RECORDS[1])
        images = [Image.open(root / "images" / n) for n in RECORDS[1]["image"]]
        a, b = (p(text=p.apply_chat_template(messages, tokenize=False), images=images, return_tensors="pt",
                  add_special_tokens=False) for p in (exported, source))  # fmt: skip
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
        main(["hf-to-neva", "--hf", str(out), "--out", str(tmp_path / "again")])
    again, first = load_model(tmp_path / "again").state_dict(), load_model(ckpt).state_dict()
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


@pytest.mark.parametrize("raw", [False, True], ids=["template", "raw"])
def test_greedy_generation_equals_transformers_left_padded(imported, raw):
    """``neva.generate``'s path (``Answerer``: prompt building, one left-padded batch, the KV cache) against
    ``generate`` on the processor's left-padded batch of the same prompts: a two-image prompt, a one-image one and a
    text-only one; the chat template's text, or (``--raw``) the prompt as given with each image as the processor
    expands its ``<start_of_image>``."""
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    hf, _, ckpt, _, root = imported
    items = [("compare <image> and <image>.", ["b.png", "c.png"]), ("<image>\nwhat is it?", ["a.png"]),
             ("say hi.", [])]  # fmt: skip
    with one_thread():
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6), raw=raw)
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        prepared = [answerer.prepare((prompt, [root / "images" / n for n in names])) for prompt, names in items]
        ours = answerer.generate_ids(prepared)
        processor = make_processor(answerer.tokenizer)
        processor.tokenizer.padding_side = "left"
        if raw:
            texts = [prompt.replace("<image>", "<start_of_image>") for prompt, _ in items]
        else:
            messages = [[{"role": "user", "content": m["content"]}] for m in
                        (hf_messages({"conversations": [{"from": "human", "value": p}]})[0] for p, _ in items)]  # fmt: skip
            texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        images = [[Image.open(root / "images" / n) for n in names] for _, names in items]
        inputs = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=raw)
        for p, ids, mask in zip(prepared, inputs["input_ids"], inputs["attention_mask"]):
            assert p.ids == ids[mask.bool()].tolist()
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == out[:, inputs["input_ids"].shape[1] :].tolist()


def test_final_logit_softcap_equals_gemma3_for_causal_lm():
    """The decoder's final softcap (``LLMConfig.final_logit_softcapping``) as ``Gemma3ForCausalLM`` applies it (the
    conditional-generation class applies none, which the import follows)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from neva.checkpoint.hf_gemma3 import hf_key_to_neva, llm_config_from_gemma3
    from neva.models.llama import LlamaDecoder
    from tests.checkpoint.tiny_gemma3 import TEXT
    from tests.hf_oracle import randomise_inits

    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**TEXT, final_logit_softcapping=2.0)).eval()
    randomise_inits(hf)
    text = {k: v for k, v in hf.config.to_dict().items() if k != "final_logit_softcapping"}
    cfg = dataclasses.replace(llm_config_from_gemma3(text, tie=True), final_logit_softcapping=2.0)
    ours = LlamaDecoder(cfg)
    state = {hf_key_to_neva("model.language_model." + k[len("model.") :]): v for k, v in hf.state_dict().items()
             if k.startswith("model.")}  # fmt: skip
    ours.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()}, strict=False)
    ours.reset_rope()
    ids = torch.randint(3, BOI, (2, 13))
    with one_thread(), torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ours.embed(ids))
    assert expected.abs().max() < 2.0 and rel_err(got, expected) < 1e-5


def test_gemma3_4b_presets_are_the_import_of_its_config():
    """``model=gemma3_4b vision=siglip_so400m_896`` (the preset's model) is what the import reads from
    google/gemma-3-4b-it's config.json (its fields, transformers' defaults for the rest), 256 tokens per image."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    from neva.checkpoint.hf_gemma3 import neva_config_from_gemma3
    from neva.models.config import LLMConfig, VisionConfig
    from neva.models.presets import LLM_PRESETS, VISION_PRESETS

    text = Gemma3TextConfig(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, vocab_size=262208, sliding_window=1024, rope_scaling={"factor": 8.0, "rope_type": "linear"},
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=1152, image_size=896, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27,
        patch_size=14, vision_use_head=False, layer_norm_eps=1e-6,
    )  # fmt: skip
    cfg = neva_config_from_gemma3(Gemma3Config(text_config=text, vision_config=vision).to_dict())
    assert cfg.llm == LLMConfig(**LLM_PRESETS["gemma3_4b"])
    assert cfg.vision == VisionConfig(**VISION_PRESETS["siglip_so400m_896"])
    assert cfg.num_image_tokens == 256
