"""The video model side without an HF twin: stride 1 (NeMo's Video-NeVA, frames unpooled) and the configs refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from neva.models.media import Media, MediaInputs, image_media
from neva.models.neva import NevaModel
from neva.models.presets import VISION_PRESETS, build_config
from neva.models.video import VideoConfig


def _model(cfg) -> NevaModel:
    torch.manual_seed(0)
    model = NevaModel(cfg).eval()
    model.init_weights()
    return model


@pytest.mark.parametrize("projector", ["mlp2x_gelu", "mlp_downsample"])
def test_unpooled_frames_are_images_at_the_same_positions(projector):
    """Stride 1 pools nothing: a frame takes an image's positions and features (the image path is HF's, tested
    elsewhere), whatever the projector merges; video and image tokens share one id, the positions tell them apart."""
    cfg = dataclasses.replace(build_config(projector_type=projector), video=VideoConfig(spatial_pool_stride=1))
    assert cfg.video_tokens(3) == 3 * cfg.num_image_tokens
    model = _model(cfg)
    side, n = cfg.vision.image_size, cfg.video_tokens(3)
    frames = torch.randint(0, 256, (3, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(1, 100, (1, n + 8), generator=torch.Generator().manual_seed(2))
    ids[0, 4 : 4 + n] = cfg.video_token
    positions = (ids == cfg.video_token).nonzero()
    with torch.no_grad():
        as_video = model(ids, Media(video=MediaInputs(frames, positions)))
        as_images = model(ids, image_media(frames, torch.tensor([3]), positions=positions))
    assert torch.equal(as_video, as_images)


def test_pooling_configs_that_have_no_grid_are_refused():
    base = build_config()
    video = VideoConfig(spatial_pool_stride=2)
    with pytest.raises(ValueError, match="vision_select_feature=patch"):
        dataclasses.replace(build_config(vision={**VISION_PRESETS["tiny"], "vision_select_feature": "cls_patch"}),
                            video=video)  # fmt: skip
    with pytest.raises(ValueError, match="mlp_downsample"):
        dataclasses.replace(build_config(projector_type="mlp_downsample"), video=video)
    with pytest.raises(ValueError, match="spatial_pool_mode"):
        VideoConfig(spatial_pool_mode="conv")
    model = _model(base)
    with pytest.raises(ValueError, match="without video"):
        video = MediaInputs(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.long))
        model(torch.ones(1, 4, dtype=torch.long), Media(video=video))
