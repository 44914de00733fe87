"""LLaVA-NeXT's own checkpoint format with AnyRes (``llava_llama`` of LLaVA-1.6, LLaVA-OneVision's ``model_type:
llava`` + ``LlavaQwenForCausalLM``): a tiny random transformers model written in the original layout by LLaVA-NeXT's
key names and config keys (here, independently of neva's tables: transformers' conversion scripts run this mapping
the other way), imported with ``hf-to-neva``, gives transformers' logits and greedy tokens on AnyRes images of
several aspect ratios; LLaVA-NeXT's ``(width, height)`` pinpoints and its truncating ``unpad_image`` are its own."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.llava_original import anyres_config
from neva.checkpoint.neva_format import load_config, load_metadata, load_model
from neva.convert import main as convert_main
from neva.data.anyres import tile_image
from neva.models.anyres import AnyResConfig, batch_feature_index, feature_index, grid_shape, unpadded_bounds
from neva.models.generation import GenerationConfig, generate
from neva.models.media import image_media
from tests.checkpoint.tiny_hf import SP_VOCAB
from tests.checkpoint.tiny_llava_original import CLIP_MEAN, CLIP_STD, make_tower, save_tower, write_tokenizer
from tests.hf_oracle import VISION_KW, tiny_llava_next

# (width, height): wide, tall, a small square (a tie between the 1x2 and 2x1 grids: the first pinpoint wins, so the
# (width, height) reading of LLaVA-NeXT's list decides the grid), and one that pools under anyres_max_3
SIZES = [(70, 26), (24, 61), (20, 20), (90, 80)]


def _original_layout(hf) -> dict[str, torch.Tensor]:
    """transformers 5 keys → LLaVA-NeXT's (``LlavaLlamaForCausalLM`` / ``LlavaQwenForCausalLM``): the decoder under
    ``model.``, the projector as ``nn.Sequential`` indices, the trained tower inside its ``CLIPVisionTower`` /
    ``SigLipVisionTower`` wrapper (which deletes SigLIP's last layer before saving), ``image_newline`` under
    ``model.``."""
    out = {}
    last = f"model.vision_tower.encoder.layers.{hf.config.vision_config.num_hidden_layers - 1}."
    siglip = hf.config.vision_config.model_type == "siglip_vision_model"
    for key, value in hf.state_dict().items():
        if siglip and key.startswith(last):
            continue
        for theirs, ours in (
            ("model.language_model.", "model."),
            ("model.multi_modal_projector.linear_1.", "model.mm_projector.0."),
            ("model.multi_modal_projector.linear_2.", "model.mm_projector.2."),
            ("model.vision_tower.", "model.vision_tower.vision_tower.vision_model."),
            ("model.image_newline", "model.image_newline"),
            ("lm_head.", "lm_head."),
        ):
            if key.startswith(theirs):
                out[ours + key[len(theirs) :]] = value.detach().clone().contiguous()
                break
        else:
            raise AssertionError(f"unmapped {key}")
    return out


def _write_original(root, hf, mm: dict, model_type: str, architecture: str):
    """The LLaVA-NeXT directory of ``hf`` and, where ``mm_vision_tower`` points, a *different* random CLIP tower of
    the same shape (``same_tower``: ``hf``'s own, the SigLIP case): ``unfreeze_mm_vision_tower`` says LLaVA loads the
    checkpoint's trained tower, so only that one gives transformers' logits."""
    tower_dir = save_tower(root / "tower", hf.model.vision_tower) if mm.pop("same_tower", False) else None
    tower_dir = tower_dir or make_tower(root / "tower", seed=11)
    d = root / "llava"
    d.mkdir()
    text = {k: v for k, v in hf.config.text_config.to_dict().items() if k not in ("architectures", "model_type")}
    config = {**text, "model_type": model_type, "architectures": [architecture], "mm_vision_tower": str(tower_dir),
              "mm_hidden_size": hf.config.vision_config.hidden_size, "mm_projector_type": "mlp2x_gelu",
              "mm_use_im_start_end": False, "mm_use_im_patch_token": False, "unfreeze_mm_vision_tower": True,
              "tokenizer_padding_side": "right", "use_mm_proj": True, **mm}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_file(_original_layout(hf), str(d / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(d)
    return d


def _next():
    hf = tiny_llava_next(3, text_kw={"vocab_size": SP_VOCAB})
    # LLaVA-NeXT lists pinpoints as (width, height): transformers' [height, width] pairs swapped, order kept
    pins = [[w, h] for h, w in hf.config.image_grid_pinpoints]
    mm = dict(image_aspect_ratio="anyres", image_grid_pinpoints=pins, mm_patch_merge_type="spatial_unpad",
              mm_vision_select_layer=hf.config.vision_feature_layer, mm_vision_select_feature="patch")  # fmt: skip
    return hf, mm, "llava_llama", "LlavaLlamaForCausalLM"


def _onevision():
    from tests.models.test_anyres_onevision import MAX, PINPOINTS, tiny_onevision

    hf = tiny_onevision(4, text_kw={"vocab_size": SP_VOCAB})
    hf.config.vision_feature_layer = -2  # LLaVA-NeXT's SigLIP: the second-to-last layer's output, whatever the config
    # transformers' expansion of LLaVA-NeXT's range form is [height, width]; LLaVA-NeXT's own is (width, height):
    # (i, j) for i, j over the range, i outermost, i the width
    s = hf.config.vision_config.image_size
    n = int(PINPOINTS[-2])
    hf.config.image_grid_pinpoints = [[j * s, i * s] for i in range(1, n + 1) for j in range(1, n + 1)]
    mm = dict(image_aspect_ratio=f"anyres_max_{MAX}", image_grid_pinpoints=PINPOINTS, same_tower=True,
              mm_patch_merge_type="spatial_unpad", mm_vision_select_layer=-2,
              mm_vision_select_feature="patch", mm_tunable_parts="mm_vision_tower,mm_mlp_adapter,mm_language_model",
              mm_spatial_pool_mode="bilinear", mm_newline_position="one_token", image_token_index=SP_VOCAB - 1,
              image_crop_resolution=None, image_split_resolution=None, use_pos_skipping=False,
              pos_skipping_range=4096, vision_tower_pretrained=None)  # fmt: skip
    return hf, mm, "llava", "LlavaQwenForCausalLM"


def _hf_pixels(imgs, cfg):
    """Every image's neva tiles, normalised as the tower directory's processor says, zero-padded to one tensor."""
    tiles = [tile_image(im, cfg.anyres, cfg.vision.image_size).float() / 255 for im in imgs]
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    tiles = [(t - mean) / std for t in tiles]
    out = torch.zeros(len(tiles), max(len(t) for t in tiles), *tiles[0].shape[1:])
    for k, t in enumerate(tiles):
        out[k, : len(t)] = t
    return out


@pytest.mark.parametrize("variant", [_next, _onevision], ids=["llava_next", "onevision"])
def test_original_anyres_checkpoint_gives_transformers_logits_and_tokens(tmp_path, variant):
    hf, mm, model_type, architecture = variant()
    video = "mm_spatial_pool_mode" in mm
    src = _write_original(tmp_path, hf, mm, model_type, architecture)
    args = ["hf-to-neva", "--hf", str(src), "--conv-template", "vicuna_v1", "--out", str(tmp_path / "ckpt")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_main(args)
    assert any("video path" in str(w.message) for w in caught) == video
    cfg, meta = load_config(tmp_path / "ckpt"), load_metadata(tmp_path / "ckpt")
    assert meta["image_aspect_ratio"] == mm["image_aspect_ratio"] and meta["source"]["vision_weights"] == str(src)
    assert cfg.anyres.grid_pinpoints == [list(p) for p in hf.config.image_grid_pinpoints]
    assert cfg.anyres.unpad_truncate and cfg.image_token_id == SP_VOCAB  # no <image> row, as LLaVA
    shortened = cfg.vision.kind == "siglip"  # LLaVA-NeXT saved its SigLIP without the last layer
    assert cfg.vision.num_layers == hf.config.vision_config.num_hidden_layers - shortened
    model = load_model(tmp_path / "ckpt").eval()

    rng = np.random.default_rng(1)
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]
    sizes = [(h, w) for w, h in SIZES]
    s = cfg.vision.image_size
    if cfg.anyres.max_num_patches is None:  # LLaVA-1.6's list has no 1x1: the first of the tied 1x2 / 2x1 wins
        assert grid_shape(sizes[2], cfg.anyres.grid_pinpoints, s) == (1, 2)
    counts = [cfg.image_tokens(size) for size in sizes]
    hf_image = hf.config.image_token_index
    rows = [[1, 5, *[hf_image] * c, 7, 9] for c in counts] + [[1, 5, 6, 7, 9]]  # one image a row, one text-only
    width = max(map(len, rows))
    hf_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    ids = torch.where(hf_ids == hf_image, cfg.image_token_id, hf_ids)  # LLaVA's splice id: no vocabulary row
    lay, _ = batch_feature_index(cfg.anyres, cfg.num_image_tokens, s, sizes)
    tiles = torch.cat([tile_image(im, cfg.anyres, s) for im in imgs])
    with torch.no_grad():
        expected = hf(input_ids=hf_ids, pixel_values=_hf_pixels(imgs, cfg), image_sizes=torch.tensor(sizes)).logits
        media = image_media(tiles, torch.tensor([1] * len(imgs) + [0]), positions=(ids == cfg.image_token_id).nonzero(),
                            index=lay.index, weight=lay.weight)  # fmt: skip
        got = model(ids, media)
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
    if cfg.anyres.max_num_patches is not None:
        assert feature_index(cfg.anyres, cfg.num_image_tokens, s, sizes[3]).weight is not None  # pooled

    # greedy generation with the KV cache on the wide image
    with torch.no_grad():
        theirs = hf.generate(input_ids=hf_ids[:1, : len(rows[0])], pixel_values=_hf_pixels(imgs[:1], cfg),
                             image_sizes=torch.tensor(sizes[:1]), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)[0, len(rows[0]) :]  # fmt: skip
    ours = generate(model, [ids[0, : len(rows[0])].tolist()], tile_image(imgs[0], cfg.anyres, s), [1],
                    GenerationConfig(max_new_tokens=6), image_sizes=sizes[:1])[0]  # fmt: skip
    assert ours == theirs.tolist()

    # on to llava-hf (LlavaNext / LlavaOnevision): a mean <image> row appended, warned about the rounding of unpad
    with pytest.warns(UserWarning, match="unpad_truncate"):
        out = export_llava(tmp_path / "ckpt", tmp_path / "hf")
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded).__name__ == type(hf).__name__
    with torch.no_grad():
        served = reloaded(input_ids=ids, pixel_values=_hf_pixels(imgs, cfg), image_sizes=torch.tensor(sizes)).logits
    assert torch.equal(served[..., :SP_VOCAB], expected)


def _llava_unpad_tokens(size_wh, grid_hw, per_tile_side):
    """LLaVA-NeXT's ``unpad_image`` (``int`` of the scaled side, no rounding) + one newline per row + the base."""
    ow, oh = size_wh
    ch, cw = grid_hw
    if ow / oh > cw / ch:
        ch = ch - 2 * ((ch - int(oh * (cw / ow))) // 2)
    else:
        cw = cw - 2 * ((cw - int(ow * (ch / oh))) // 2)
    return per_tile_side**2 + ch * (cw + 1)


def test_unpad_truncates_as_llava_next_where_transformers_rounds():
    s, t = VISION_KW["image_size"], VISION_KW["image_size"] // VISION_KW["patch_size"]
    pins = [[s, 3 * s], [3 * s, s], [s, 2 * s], [2 * s, s]]
    cut, rounded = AnyResConfig(grid_pinpoints=pins, unpad_truncate=True), AnyResConfig(grid_pinpoints=pins)
    want, differ = {}, []
    for w in range(5, 200):
        for h in range(5, 80):
            rows, cols = grid_shape((h, w), pins, s)
            want[h, w] = _llava_unpad_tokens((w, h), (rows * t, cols * t), t)
            top, bottom, left, right = unpadded_bounds((h, w), (rows * t, cols * t))  # transformers' rounding
            if want[h, w] != t * t + (bottom - top) * (right - left + 1):
                differ.append((h, w))
    assert differ  # sizes where transformers' rounding keeps more than LLaVA-NeXT did
    for hw in differ + list(want)[::97]:
        assert feature_index(cut, t * t, s, hw).tokens == want[hw], hw
    assert all(feature_index(rounded, t * t, s, hw).tokens != want[hw] for hw in differ)


@pytest.mark.parametrize(
    "mm, match",
    [
        (dict(image_aspect_ratio="anyres", mm_patch_merge_type="spatial_unpad_maxpool2x2"), "mm_patch_merge_type"),
        (dict(image_aspect_ratio="anyres", mm_patch_merge_type="spatial_unpad_nobase"), "mm_patch_merge_type"),
        (dict(image_aspect_ratio="crop_split"), "image_aspect_ratio='crop_split'"),
        (dict(image_aspect_ratio="pad", mm_patch_merge_type="spatial_unpad"), "mm_patch_merge_type"),
        (dict(image_aspect_ratio="anyres_max_9", mm_patch_merge_type="spatial"), "anyres_max_9"),
        (dict(image_aspect_ratio="anyres", mm_patch_merge_type="spatial"), "image_grid_pinpoints"),
    ],
)
def test_layouts_neva_does_not_compute_are_refused_by_key(mm, match):
    if "anyres_max" in mm["image_aspect_ratio"]:
        mm["image_grid_pinpoints"] = "(1x1),...,(3x3)"
    with pytest.raises(ValueError, match=match):
        anyres_config(mm, 28, "src")


def test_grid_pinpoints_forms_read_as_llava_next_reads_them():
    """The range form expands i-major with i the width; a list literal string is a list; each pair is (w, h)."""
    rng = anyres_config(dict(image_aspect_ratio="anyres", image_grid_pinpoints="(1x1),...,(2x3)"), 10, "src")
    assert rng.grid_pinpoints == [[10, 10], [20, 10], [30, 10], [10, 20], [20, 20], [30, 20]]
    text = anyres_config(dict(image_aspect_ratio="anyres", image_grid_pinpoints="[[20, 10], [10, 30]]"), 10, "src")
    assert text.grid_pinpoints == [[10, 20], [30, 10]] and text.patch_merge_type == "flat"
