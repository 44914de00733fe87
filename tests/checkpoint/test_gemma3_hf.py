"""Gemma 3 against transformers' own ``Gemma3ForConditionalGeneration`` (a tiny random model written as a hub
directory, ``tests/checkpoint/tiny_gemma3.py``): import, whole-model logits (images of several sizes through the
family's image processor, two images, text only; sliding and global layers, bidirectional attention inside each
image), packed rows equal to each sample alone, export → reload."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from neva.checkpoint.hf_gemma3 import export_gemma3, import_gemma3
from neva.checkpoint.neva_format import load_model
from neva.models.media import Media, MediaInputs, image_media
from tests.checkpoint.tiny_gemma3 import BOI, EOI, IMAGE, TOKENS_PER_IMAGE, tiny_gemma3_dir
from tests.checkpoint.tiny_hf import one_thread
from tests.models.test_hf_parity import rel_err

SIZES = [(70, 45), (40, 100), (150, 60)]  # (width, height): three aspect ratios, all resized to 28 × 28


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    with one_thread():
        hf, hf_dir = tiny_gemma3_dir(root)
        ckpt = import_gemma3(hf_dir, root / "neva")
        model = load_model(ckpt).eval()
    return hf, hf_dir, ckpt, model


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
    hf, _, _, model = imported
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


def test_packed_row_equals_each_sample_alone(imported):
    """Three samples in one packed row (positions restart, segments isolate; the collator's image positions):
    each equals transformers' logits of the sample alone."""
    hf, _, _, model = imported
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
    from transformers import Gemma3ForConditionalGeneration

    hf, _, ckpt, _ = imported
    with one_thread():
        out = export_gemma3(ckpt, tmp_path / "export", dtype=torch.float32)
        assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"
        reloaded = Gemma3ForConditionalGeneration.from_pretrained(str(out)).eval()
        ids, pixels = _prompt(2, 5, 7)[None], _pixels(SIZES[:2])
        assert torch.equal(_hf_logits(reloaded, ids, pixels), _hf_logits(hf, ids, pixels))
        again = import_gemma3(out, tmp_path / "again")
    assert torch.equal(load_model(again).llm.tok_embeddings.weight, load_model(ckpt).llm.tok_embeddings.weight)
