"""The rehearsal's synthetic batches (``neva.training.rehearsal_inputs``) carry what the real data path collates for a
sample of the planned shape: an AnyRes image's tiles, positions, feature index and pooling weights; a video's frames
and positions; the sequence length the planner plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.data.anyres import AnyResProcessor
from neva.data.collate import Collator
from neva.data.dataset import ConversationDataset, EncoderSettings
from neva.data.front_ends import TiledImages
from neva.data.images import CallableImageSource
from neva.data.synthetic import build_tokenizer
from neva.data.templates.registry import get_template
from neva.parallel.layout import Layout
from neva.planner.plan import plan_run
from neva.training.rehearsal_inputs import synthetic_micro_batches

# The tiny CLIP's 32 px tiles in 1x1 ... 2x2 grids, spatial_unpad + image_newline, LLaVA-OneVision's pooling
# (anyres_max_1: every grid of more than one tile's features is pooled bilinearly, with weights).
ANYRES = ["+stage=finetune", "cluster=dgx_a100", "trainer.devices=1", "model.global_batch_size=1", "model.micro_batch_size=1",
          "model.mm_cfg.image_grid_pinpoints=[[32,32],[32,64],[64,32],[64,64]]",
          "model.data.image_aspect_ratio=anyres_max_1"]  # fmt: skip
TOKEN_KEYS_OF_THE_SHAPE = ("input_ids", "labels", "position_ids", "segment_ids")
IMAGE_FIELDS_OF_THE_SHAPE = ("pixels", "items_per_row", "positions", "index", "weight")


def _tensors_of_the_shape(batch) -> dict:
    image = batch.media.image
    return {
        **{k: getattr(batch, k) for k in TOKEN_KEYS_OF_THE_SHAPE},
        **{f: getattr(image, f) for f in IMAGE_FIELDS_OF_THE_SHAPE},
    }


def _collate(cfg, ncfg, samples):
    data = cfg.model.data
    return Collator(0, data.seq_length or ncfg.llm.max_seq_len, data.pad_to_multiple_of, data.packing)(samples)


@pytest.mark.parametrize("size", [None, (24, 64)], ids=["largest_pinpoint", "wide_unpadded"])
def test_an_anyres_rehearsal_batch_is_what_the_data_path_collates(size: tuple[int, int] | None) -> None:
    """One real record with one image of the planned size (default: the largest pinpoint, the planner's worst case)
    through the dataset (AnyRes tiling, feature index, pooling) and the collator, against the rehearsal's synthetic
    sample with as many text tokens: the same batch shapes, the same feature index and weights, the planner's
    positions and sequence length."""
    cfg = compose_config(ANYRES)
    tokenizer = build_tokenizer()
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ncfg = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    ncfg = dataclasses.replace(ncfg, image_token_id=image_id)
    h, w = size or (64, 64)
    record = {"id": 0, "image": "a.png",
              "conversations": [{"from": "human", "value": "<image>\nwhat is it"}, {"from": "gpt", "value": "two"}]}  # fmt: skip
    settings = EncoderSettings(tokenizer=tokenizer, template=get_template("vicuna_v1", tokenizer),
                               image_token_id=image_id, num_image_tokens=ncfg.num_image_tokens, max_length=1024)  # fmt: skip
    source = CallableImageSource(lambda _: Image.new("RGB", (w, h), (200, 10, 10)))
    sample = ConversationDataset([record], settings, source, TiledImages(AnyResProcessor(ncfg)))[0]
    real = _collate(cfg, ncfg, [sample])
    positions = sample["image_positions"].numel()
    text_tokens = sample["input_ids"].numel() - positions

    layout = Layout.from_config(cfg.model, 1)
    fake = synthetic_micro_batches(cfg, ncfg, layout, text_tokens, 0.5, image_size=size)[0]
    fakes, reals = _tensors_of_the_shape(fake), _tensors_of_the_shape(real)
    for key, tensor in reals.items():
        assert tensor is not None, key
        assert (fakes[key].shape, fakes[key].dtype) == (tensor.shape, tensor.dtype), key
    assert torch.equal(fakes["index"], reals["index"])
    assert torch.equal(fakes["weight"], reals["weight"])
    assert int((fake.input_ids == image_id).sum()) == positions
    assert fakes["pixels"].shape[0] > 1  # the tiles went through, not one fixed-size image

    planned = plan_run(cfg, text_tokens=text_tokens, model=ncfg, image_size=size)
    image = planned.extra["image"]
    assert (image["tokens"], image["tiles"]) == (positions, reals["pixels"].shape[0])
    assert planned.seq_len == fake.input_ids.shape[1]


def test_a_video_rehearsal_batch_holds_the_planned_frames_and_positions() -> None:
    """``plan.num_frames``: one video per sample, its frames through the tower and ``NevaConfig.video_tokens``
    positions carrying the video token, the sequence the planner plans; no image."""
    cfg = compose_config(["+stage=finetune", "cluster=dgx_a100", "trainer.devices=1", "model.global_batch_size=2",
                          "model.micro_batch_size=2", "model.mm_cfg.mm_spatial_pool_stride=2"])  # fmt: skip
    ncfg = neva_config_from_mm(cfg.model.mm_cfg)
    frames = 3
    (batch,) = synthetic_micro_batches(cfg, ncfg, Layout.from_config(cfg.model, 1), 20, 0.5, num_frames=frames)
    video = batch.media.video
    assert video.frames.tolist() == [frames, frames]
    assert video.pixels.shape == (2 * frames, 3, ncfg.vision.image_size, ncfg.vision.image_size)
    assert video.positions.shape == (2 * ncfg.video_tokens(frames), 2)
    assert int((batch.input_ids == ncfg.video_token).sum()) == 2 * ncfg.video_tokens(frames)
    assert batch.media.image is None
    assert plan_run(cfg, text_tokens=20, num_frames=frames).seq_len == batch.input_ids.shape[1]
