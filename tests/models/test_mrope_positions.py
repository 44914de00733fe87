"""M-RoPE positions (neva/models/mrope.py) = transformers' ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL,
per sample: text only, one image, two images of different grids, videos (Qwen2.5-VL's timed temporal axis, Qwen3-VL's
per-frame layout with timestamps), in one left-padded HF batch."""

import pytest
import torch

from neva.errors import InputError
from neva.models.mrope import mrope_positions
from tests.models.qwen_vl_oracle import IMAGE, MERGE, TOKENS_PER_SECOND, VIDEO, item, qwen3_video, text, tiny_qwen_vl

VIDEO_GRID = (3, 4, 6)  # 3 temporal patches of 2×3 merged tokens: the temporal axis outruns max(h, w) = 3


def samples(family: str) -> list[dict]:
    """Each: ids, image grids, video grids, seconds per temporal grid."""
    video = qwen3_video(VIDEO_GRID, 40) if family == "qwen3_vl" else item(VIDEO, VIDEO_GRID)
    return [
        dict(ids=text(10, 1), images=[], videos=[]),
        dict(ids=text(3, 2) + item(IMAGE, (1, 4, 6)) + text(4, 3), images=[(1, 4, 6)], videos=[]),
        dict(
            ids=text(2, 4) + item(IMAGE, (1, 4, 4)) + text(1, 5) + item(IMAGE, (1, 8, 2)) + text(3, 6),
            images=[(1, 4, 4), (1, 8, 2)],
            videos=[],
        ),
        dict(ids=text(2, 7) + video + text(5, 8), images=[], videos=[VIDEO_GRID], seconds=[0.9]),
        dict(
            ids=item(IMAGE, (1, 2, 4)) + text(2, 9) + video + text(1, 10),
            images=[(1, 2, 4)],
            videos=[VIDEO_GRID],
            seconds=[1.3],
        ),
    ]


def hf_rope_index(model, family: str, batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's positions ``[3, B, L]`` and deltas ``[B, 1]`` for the samples left-padded into one batch."""
    width = max(len(s["ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, width - len(s["ids"]) :] = torch.tensor(s["ids"])
        mask[row, width - len(s["ids"]) :] = 1
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    images = [g for s in batch for g in s["images"]]
    videos = [g for s in batch for g in s["videos"]]
    kw = dict(
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        attention_mask=mask,
    )
    if family == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor([x for s in batch for x in s.get("seconds", [])])
    positions, deltas = model.model.get_rope_index(ids, **kw)
    return positions, deltas, mask


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_positions_and_deltas_equal_hf_get_rope_index(family):
    batch = samples(family)
    expected, deltas, mask = hf_rope_index(tiny_qwen_vl(family), family, batch)
    for row, s in enumerate(batch):
        got, delta = mrope_positions(
            torch.tensor(s["ids"]),
            torch.tensor(s["images"]).reshape(-1, 3),
            torch.tensor(s["videos"]).reshape(-1, 3),
            spatial_merge_size=MERGE,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            family=family,
            second_per_grid_ts=s.get("seconds"),
            tokens_per_second=TOKENS_PER_SECOND,
        )
        assert torch.equal(got, expected[:, row, mask[row].bool()]), (family, row)
        assert delta == int(deltas[row, 0]), (family, row)
        assert got.shape == (3, len(s["ids"]))
    # The cases exercise what they name: spread-out time (Qwen2.5-VL), axes that differ, a nonzero delta.
    video_row, _ = mrope_positions(
        torch.tensor(batch[3]["ids"]),
        video_grids=torch.tensor([VIDEO_GRID]),
        spatial_merge_size=MERGE,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        family=family,
        second_per_grid_ts=[0.9],
        tokens_per_second=TOKENS_PER_SECOND,
    )
    times = video_row[0, torch.tensor(batch[3]["ids"]) == VIDEO].unique()
    # Qwen3-VL: each frame starts after the previous one's max(h, w) = 3, its end, timestamp and start tokens.
    assert (times - times[0]).tolist() == {"qwen2_vl": [0, 1, 2], "qwen2_5_vl": [0, 3, 7], "qwen3_vl": [0, 7, 14]}[
        family
    ]
    assert int(deltas.abs().sum()) > 0


def test_token_counts_that_do_not_match_the_grids_are_refused():
    ids = torch.tensor(text(2, 1) + item(IMAGE, (1, 4, 4)))
    kw = dict(spatial_merge_size=MERGE, image_token_id=IMAGE, video_token_id=VIDEO)
    with pytest.raises(InputError, match=r"image 1 of grid \[1, 4, 6\] needs 6 consecutive tokens at 3, found 4"):
        mrope_positions(ids, torch.tensor([[1, 4, 6]]), **kw)
    with pytest.raises(InputError, match="more images in the ids than the 0 image grids"):
        mrope_positions(ids, **kw)
    with pytest.raises(InputError, match="2 image grids for 1 images"):
        mrope_positions(ids, torch.tensor([[1, 4, 4], [1, 2, 2]]), **kw)
