"""GLM-4.1V's image sizes against transformers' own rule: ``glm4v_resize`` (the family's ``TowerSpec.fit``) equals
``Glm4vImageProcessor``'s ``smart_resize`` (its budget counted over two frames, a short side scaled up first) on a
spread of sizes and budgets, and the front end's grid and token count equal ``get_number_of_image_patches``."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import Glm4vImageProcessorPil
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from neva.data.glm4v_images import glm4v_resize
from neva.data.images import ImageError
from neva.data.qwen_images import QwenImageSpec, image_grid, image_token_count
from neva.models.config import VisionConfig
from neva.models.presets import VISION_PRESETS

BUDGETS = [(None, None), (2 * 28 * 28, 2 * 28 * 28 * 12), (56 * 56, 28 * 28 * 64)]


@pytest.mark.parametrize("low, high", BUDGETS)
def test_resize_and_counts_equal_the_processors(low, high):
    vision = VisionConfig(**VISION_PRESETS["glm4v_9b"])
    spec = QwenImageSpec.for_tower(vision, low, high)
    processor = Glm4vImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}, patch_size=14, merge_size=2
    )
    rng = np.random.default_rng(0)
    sizes = [(10, 60), (27, 27), (28, 5000), (1080, 1920), (333, 517)]
    sizes += [tuple(int(x) for x in rng.integers(8, 2500, size=2)) for _ in range(40)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        want = smart_resize(2, h, w, 2, 28, spec.min_pixels, spec.max_pixels)
        assert glm4v_resize(spec, h, w) == want, (h, w)
        patches = processor.get_number_of_image_patches(h, w, {})
        t, gh, gw = image_grid(spec, h, w)
        assert t * gh * gw == patches and image_token_count(spec, h, w) == patches // 4, (h, w)


def test_a_long_image_is_refused_in_one_line():
    spec = QwenImageSpec.for_tower(VisionConfig(**VISION_PRESETS["glm4v_9b"]))
    with pytest.raises(ImageError, match="aspect ratio above 200"):
        glm4v_resize(spec, 30, 7000)
