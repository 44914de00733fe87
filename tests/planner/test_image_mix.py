"""``plan.image_tokens``: an AnyRes plan from a declared mean of positions per image, or from the mean measured on the
configured data's image headers (real files of mixed sizes, one corrupt, one missing, one two-image OneVision
record), the planner naming which it used."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.plan import main
from neva.planner.image_mix import SEED, measure_image_mix
from neva.planner.plan import sample_tokens
from neva.typed import ConfigError

BASE = ["+stage=finetune", "cluster=dgx_a100", "trainer.devices=2", "model.micro_batch_size=1",
        "vision=clip_vit_l14_336", "model.mm_cfg.image_grid_pinpoints='(1x1),...,(6x6)'",
        "model.data.image_aspect_ratio=anyres_max_9"]  # fmt: skip
# (width, height): small, wide, tall, large (pooled under anyres_max_9), one not a multiple of the tile
SIZES = [(300, 200), (2016, 672), (50, 1500), (1900, 1800), (700, 333)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    (root / "img").mkdir()
    for k, (w, h) in enumerate(SIZES):
        Image.new("RGB", (w, h), (k * 40, 90, 200)).save(root / "img" / f"{k}.png")
    (root / "img" / "bad.png").write_bytes(b"not an image at all")
    conv = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A picture."}]
    records = [{"id": str(k), "image": f"{k}.png", "conversations": conv} for k in range(len(SIZES))]
    records += [
        {"id": "two", "image": ["0.png", "1.png"], "conversations": [{"from": "human", "value": "<image><image>"},
                                                                     {"from": "gpt", "value": "Two."}]},
        {"id": "bad", "image": "bad.png", "conversations": conv},
        {"id": "gone", "image": "missing.png", "conversations": conv},
        {"id": "text", "conversations": conv},
    ]  # fmt: skip
    (root / "d.json").write_text(json.dumps(records))
    return root


def _overrides(root):
    return [f"model.data.data_path={root / 'd.json'}", f"model.data.image_folder={root / 'img'}"]


def test_measured_mean_follows_each_image_and_counts_skips(data, capsys):
    cfg = compose_config(BASE + _overrides(data))
    ncfg = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    # each tiled image by its size; the two-image record: one padded tile each (OneVision), plus its newline
    tokens = [ncfg.image_tokens((h, w)) for w, h in SIZES] + [ncfg.num_image_tokens + 1] * 2
    mix = measure_image_mix(ncfg, cfg.model.data)
    assert (mix.images, mix.records, mix.population) == (len(SIZES) + 2, len(SIZES) + 3, len(SIZES) + 3)
    assert mix.skipped == {"corrupt_image": 1, "missing_image": 1}
    assert mix.tokens == pytest.approx(sum(tokens) / len(tokens))
    assert max(tokens) > mix.tokens > min(tokens)

    plan = main(BASE + _overrides(data) + ["plan.image_tokens=data"])[0]
    image = plan.extra["image"]
    assert image["tokens"] == math.ceil(mix.tokens) and image["tiles"] == math.ceil(mix.tiles)
    assert plan.seq_len == sample_tokens(cfg, image["tokens"], None)
    out = capsys.readouterr().out
    assert "measured from model.data.data_path" in out and "1 corrupt_image, 1 missing_image" in out

    few = measure_image_mix(ncfg, cfg.model.data, limit=3)  # a seeded sample: the same three records every time
    assert few.records == 3 and few == measure_image_mix(ncfg, cfg.model.data, limit=3) and SEED == 0


def test_declared_mean_and_refusals(data, capsys):
    plan = main(BASE + ["plan.image_tokens=1500.5"])[0]
    assert plan.extra["image"]["tokens"] == 1501 and plan.extra["image"]["tiles"] == math.ceil(1500.5 / 576)
    assert "plan.image_tokens=1500.5" in capsys.readouterr().out
    fixed = BASE[:5]
    with pytest.raises(ConfigError, match="needs an AnyRes model"):
        main(fixed + ["plan.image_tokens=600"])
    with pytest.raises(ConfigError, match=r"plan\.image_size"):
        main(BASE + ["plan.image_tokens=600", "plan.image_size=336x672"])
    with pytest.raises(ConfigError, match="image_tokens"):
        main(BASE + ["plan.image_tokens=-3"])
    with pytest.raises(ConfigError, match=r"plan\.image_tokens=N"):
        main(BASE + ["plan.image_tokens=data"])  # synthetic data: nothing to measure
    with pytest.raises(ConfigError, match="one size"):
        main(BASE + ["plan.image_tokens=600", "plan.rehearse=true"])  # a mean is no image the rehearsal can run
