"""The llava-hf export of a pooled AnyRes model (``anyres_max_N``) as LlavaOnevisionForConditionalGeneration: a tiny
random transformers OneVision imported, exported, reloaded by transformers with identical logits; the exported image
processor's pixels and processor's token count are the source's."""

from __future__ import annotations

import json
import types
import warnings

import numpy as np
import torch
from PIL import Image
from transformers import LlavaOnevisionForConditionalGeneration
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config
from tests.checkpoint.tiny_hf import SP_VOCAB, make_tokenizer
from tests.models.test_anyres_onevision import MAX, tiny_onevision

# (width, height): pooled 4x4, unpooled 1x1, wide, tall
SIZES = [(140, 140), (30, 20), (139, 35), (36, 140)]


def test_onevision_export_reloads_with_identical_logits(tmp_path):
    hf = tiny_onevision(2, text_kw={"vocab_size": SP_VOCAB + 2, "pad_token_id": SP_VOCAB})
    s = hf.config.vision_config.image_size
    source_processor = LlavaOnevisionImageProcessorPil(size={"height": s, "width": s}, image_mean=[0.5] * 3,
                                                       image_std=[0.5] * 3,
                                                       image_grid_pinpoints=hf.config.image_grid_pinpoints)  # fmt: skip
    hf.save_pretrained(str(tmp_path / "hf"))
    make_tokenizer(tmp_path / "_sp").save_pretrained(str(tmp_path / "hf"))
    source_processor.save_pretrained(str(tmp_path / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no neva chat template in the source
        ckpt = import_llava(tmp_path / "hf", tmp_path / "ckpt", metadata={"conv_template": "vicuna_v1"})
        out = export_llava(ckpt, tmp_path / "out")
    cfg = load_config(ckpt)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaOnevisionForConditionalGeneration"]
    assert (config["model_type"], config["vision_aspect_ratio"]) == ("llava_onevision", f"anyres_max_{MAX}")
    reloaded, info = LlavaOnevisionForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))

    rng = np.random.default_rng(4)
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]
    sizes = [(h, w) for w, h in SIZES]
    batch = source_processor(imgs, return_tensors="pt")
    exported_processor = LlavaOnevisionImageProcessorPil.from_pretrained(out)
    exported = exported_processor(imgs, return_tensors="pt")
    torch.testing.assert_close(exported["pixel_values"], batch["pixel_values"], rtol=0, atol=0)

    # the exported processor's fields count neva's positions (LlavaOnevisionProcessor's own counting code)
    from transformers import LlavaOnevisionProcessor as P

    fields = json.loads((out / "processor_config.json").read_text())
    assert fields["processor_class"] == "LlavaOnevisionProcessor"
    ns = types.SimpleNamespace(image_processor=exported_processor, num_image_tokens=fields["num_image_tokens"],
                               vision_aspect_ratio=fields["vision_aspect_ratio"])  # fmt: skip
    ns._get_unpadded_features = types.MethodType(P._get_unpadded_features, ns)
    counts = [cfg.image_tokens(size) for size in sizes]
    assert [P._get_number_of_features(ns, h, w, s, s) for h, w in sizes] == counts

    image = hf.config.image_token_index
    rows = [[2, 3, *[image] * c, 5, 6] for c in counts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [1] * (width - len(r)) for r in rows])
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"]).logits
        got = reloaded.eval()(input_ids=ids, pixel_values=exported["pixel_values"], image_sizes=batch["image_sizes"])
    assert torch.equal(got.logits, expected)
    again = dict(iter_tensors(import_llava(out, tmp_path / "ckpt2")))
    for key, tensor in iter_tensors(ckpt):
        assert torch.equal(tensor, again.pop(key)), key
    assert not again
