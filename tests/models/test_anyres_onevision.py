"""LLaVA-OneVision's ``anyres_max_N`` against transformers' LlavaOnevisionForConditionalGeneration (tiny random, fp32,
SigLIP + Qwen2 as OneVision ships): the host-side token count (model and processor), logits of a batch mixing pooled,
unpooled and text-only rows, greedy generation; the pooling layout against ``F.interpolate`` as LLaVA-NeXT's
``prepare_inputs_labels_for_multimodal`` calls it."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import LlamaConfig, Qwen2Config, SiglipVisionConfig

from neva.data.anyres import tile_image
from neva.models.anyres import (
    AnyResConfig,
    AnyResMerge,
    batch_feature_index,
    feature_index,
    grid_shape,
    parse_grid_pinpoints,
    unpadded_bounds,
)
from neva.models.generation import GenerationConfig, generate
from neva.models.media import MediaInputs, image_media
from tests.hf_oracle import SIGLIP_KW, TEXT_KW, neva_from_hf, randomise_inits

S = SIGLIP_KW["image_size"]  # 35 px tiles, 5x5 patches
PINPOINTS = "(1x1),...,(4x4)"
MAX = 3  # anyres_max_3: most grids above 2x2 tiles pool, smaller ones do not


def tiny_onevision(seed: int = 0, text_cls: type = Qwen2Config, text_kw: dict | None = None):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    torch.manual_seed(seed)
    text = {**TEXT_KW, **(text_kw or {})}
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**SIGLIP_KW, vision_use_head=False),
        text_config=text_cls(**text),
        image_token_index=text["vocab_size"] - 1,
        image_grid_pinpoints=parse_grid_pinpoints(PINPOINTS, S),
        vision_aspect_ratio=f"anyres_max_{MAX}",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    return model


def _images(sizes):
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _hf_pixels(hf, imgs):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    proc = LlavaOnevisionImageProcessorPil(
        size={"height": S, "width": S},
        image_grid_pinpoints=hf.config.image_grid_pinpoints,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return proc(imgs, return_tensors="pt")  # one image per sample: every image tiled


def _processor_count(hf, h: int, w: int) -> int:
    """``LlavaOnevisionProcessor._get_number_of_features`` itself, on the attributes it reads."""
    from transformers import LlavaOnevisionProcessor as P

    ns = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_grid_pinpoints=hf.config.image_grid_pinpoints),
        num_image_tokens=(S // SIGLIP_KW["patch_size"]) ** 2,
        vision_aspect_ratio=hf.config.vision_aspect_ratio,
    )
    ns._get_unpadded_features = types.MethodType(P._get_unpadded_features, ns)
    return P._get_number_of_features(ns, h, w, S, S)


# (width, height): pooled and unpooled grids, wide and tall, rows or columns unpadded
SIZES = [(140, 140), (30, 20), (139, 35), (36, 140), (90, 70), (70, 100), (140, 41), (12, 13)]


def test_token_counts_logits_and_generation_match_llava_onevision():
    hf = tiny_onevision()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    assert cfg.anyres.max_num_patches == MAX and cfg.anyres.patch_merge_type == "spatial_unpad"
    rng = np.random.default_rng(0)
    many = [(int(w), int(h)) for w, h in rng.integers(5, 4 * S + 10, (40, 2))] + SIZES
    imgs = _images(many)
    sizes = [(im.size[1], im.size[0]) for im in imgs]
    lay, counts = batch_feature_index(cfg.anyres, cfg.num_image_tokens, S, sizes)
    batch = _hf_pixels(hf, imgs)
    with torch.no_grad():
        feats = hf.model.get_image_features(
            batch["pixel_values"], batch["image_sizes"], vision_aspect_ratio=hf.config.vision_aspect_ratio
        ).pooler_output
    # the one rule: neva's host count = transformers' model = its processor, for every size
    assert counts == [f.shape[0] for f in feats] == [_processor_count(hf, h, w) for h, w in sizes]
    assert counts == [cfg.image_tokens(s) for s in sizes]
    pooled = [feature_index(cfg.anyres, cfg.num_image_tokens, S, s).weight is not None for s in sizes]
    assert 5 <= sum(pooled) < len(pooled)
    # the layer itself: neva's tiles and gather reproduce transformers' packed features
    tiles = torch.cat([tile_image(im, cfg.anyres, S) for im in imgs])
    with torch.no_grad():
        got = ours._features("image", MediaInputs(tiles, index=lay.index, weight=lay.weight)).main
    expected = torch.cat(feats)
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5

    # a batch of rows of one image each (OneVision tiles single-image samples), pooled or not, and a text-only row
    k = [len(many) - len(SIZES) + i for i in (0, 1, 2, 3)]  # SIZES[0] pooled 4x4, [1] 1x1, [2] wide, [3] tall
    sub_imgs = [imgs[i] for i in k]
    sub_sizes = [sizes[i] for i in k]
    n = [counts[i] for i in k]
    prompts = [[2, 3, *[cfg.image_token_id] * c, 5, 6] for c in n] + [[2, 3, 4, 5, 6]]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [1] * (width - len(p)) for p in prompts])
    hb = _hf_pixels(hf, sub_imgs)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=hb["pixel_values"], image_sizes=hb["image_sizes"]).logits
        sub_lay, _ = batch_feature_index(cfg.anyres, cfg.num_image_tokens, S, sub_sizes)
        sub_tiles = torch.cat([tile_image(im, cfg.anyres, S) for im in sub_imgs])
        positions = (ids == cfg.image_token_id).nonzero()
        media = image_media(sub_tiles, torch.tensor([1, 1, 1, 1, 0]), positions=positions, index=sub_lay.index,
                            weight=sub_lay.weight)  # fmt: skip
        got = ours(ids, media)
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5

    # greedy generation with the KV cache, on the pooled image
    prompt = prompts[0]
    with torch.no_grad():
        one = _hf_pixels(hf, sub_imgs[:1])
        theirs = hf.generate(
            input_ids=torch.tensor([prompt]),
            pixel_values=one["pixel_values"],
            image_sizes=one["image_sizes"],
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
        )[0, len(prompt) :]
    mine = generate(ours, [prompt], tile_image(sub_imgs[0], cfg.anyres, S), [1], GenerationConfig(max_new_tokens=6),
                    image_sizes=sub_sizes[:1])[0]  # fmt: skip
    assert mine == theirs.tolist()


def _reference_pool(feats: torch.Tensor, size, grid, side: int, max_n: int) -> torch.Tensor:
    """LLaVA-NeXT's ``anyres_max`` branch (rewritten here): unpad the tiles' grid, bilinear-resize it when it holds
    more than 1.1²·N tiles' features, newline per row; the overview first."""
    base, tiles = feats[0], feats[1:]
    rows, cols = grid
    x = tiles.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    top, bottom, left, right = unpadded_bounds(size, (rows * side, cols * side))
    x = x[:, top:bottom, left:right]
    c, h, w = x.shape
    times = math.sqrt(h * w / (max_n * side**2))
    if times > 1.1:
        x = F.interpolate(x[None], [int(h // times), int(w // times)], mode="bilinear")[0]
    x = torch.cat([x, torch.full((c, x.shape[1], 1), 7.0)], dim=-1)  # 7.0: the newline
    return torch.cat([base, x.flatten(1, 2).transpose(0, 1)])


@pytest.mark.parametrize("max_n", [1, 4, 9])
def test_pooling_is_llava_onevision_reference(max_n):
    pins = parse_grid_pinpoints("(1x1),...,(6x6)", 16)
    cfg = AnyResConfig(grid_pinpoints=pins, max_num_patches=max_n)
    layer = AnyResMerge(cfg, 3)
    with torch.no_grad():
        layer.image_newline.fill_(7.0)
    rng = np.random.default_rng(max_n)
    for h, w in [*rng.integers(4, 120, (12, 2)).tolist(), [96, 96], [16, 95], [95, 16]]:
        lay = feature_index(cfg, 16, 16, (h, w))
        feats = torch.randn(lay.tiles, 16, 3)  # fp32: the interpolation weights are F.interpolate's fp32 ones
        want = _reference_pool(feats, (h, w), grid_shape((h, w), pins, 16), 4, max_n)
        torch.testing.assert_close(layer(feats, lay.index, lay.weight), want)


def test_llama_text_and_refusals():
    from neva.checkpoint.hf_config import llava_config_dict, neva_config_from_llava

    hf = tiny_onevision(text_cls=LlamaConfig).config.to_dict()
    cfg = neva_config_from_llava(hf)
    assert cfg.anyres.max_num_patches == MAX
    with pytest.raises(ValueError, match="vision_aspect_ratio"):
        neva_config_from_llava({**hf, "vision_aspect_ratio": "anyres"})
    assert llava_config_dict(cfg)["vision_aspect_ratio"] == f"anyres_max_{MAX}"  # exported as LlavaOnevision


def test_llava_onevision_checkpoint_imports(tmp_path):
    from neva.checkpoint.hf_import import import_llava
    from neva.checkpoint.neva_format import load_model
    from tests.checkpoint.tiny_hf import SP_VOCAB, make_tokenizer

    hf = tiny_onevision(1, text_kw={"vocab_size": SP_VOCAB + 2, "pad_token_id": SP_VOCAB})
    hf.save_pretrained(str(tmp_path / "hf"))
    make_tokenizer(tmp_path / "_sp").save_pretrained(str(tmp_path / "hf"))
    model = load_model(import_llava(tmp_path / "hf", tmp_path / "ckpt", metadata={"conv_template": "vicuna_v1"}))
    assert model.cfg.anyres.max_num_patches == MAX
    expected = neva_from_hf(hf).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
