"""``neva.generate``'s path (``Answerer``: the prompt built by the run's template, or ``--raw``; one left-padded batch;
the KV cache) on Llama 4's decoder behind the tiny CLIP tower, against transformers' ``generate`` on the same ids and
pixels through HF's Llama 4 text model inside ``LlavaForConditionalGeneration`` (neva builds no Llama 4 tower yet,
so the pairing is the llava-hf one): a two-image prompt, a one-image one and a text-only one, whose decoding crosses
the 16-token attention chunks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from neva.models.config import LLMConfig, NevaConfig
from neva.models.vision import normalize_pixels
from tests.checkpoint.tiny_hf import one_thread
from tests.parallel.harness import make_checkpoint

# Llama 4's own floor_scale: transformers scales a left-padded row's queries by its columns, neva by each token's
# position in its sample (the same factor below floor_scale; neva.models.llama._temperature).
MODEL = ["model=tiny_llama4", "++model.mm_cfg.llm.arch_overrides={num_layers:4,attn_temperature_floor_scale:8192}"]


def _hf_llava(cfg: NevaConfig, state: dict[str, torch.Tensor], pad_id: int):
    """``LlavaForConditionalGeneration`` whose text model is HF's Llama 4, holding neva's weights."""
    import transformers

    from neva.checkpoint.hf_config import llava_config_dict
    from neva.checkpoint.hf_keys import MODULE_PREFIXES, neva_key_to_hf
    from neva.checkpoint.hf_llama4 import _hf_tensors, llama4_config_dict

    t = cfg.llm
    shape = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_heads=t.num_heads, head_dim=t.head_dim)
    fields = llava_config_dict(dataclasses.replace(cfg, llm=LLMConfig(**shape)), pad_token_id=pad_id)
    text = NevaConfig(llm=t, vision=None, projector=None, image_token_id=t.vocab_size)
    fields["text_config"] = dict(llama4_config_dict(text), pad_token_id=pad_id)
    fields["tie_word_embeddings"] = t.tie_word_embeddings
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**fields)).eval()
    hf = {neva_key_to_hf(k, MODULE_PREFIXES): v for k, v in state.items() if not k.startswith("llm.")}
    for key, tensor in _hf_tensors({k: v for k, v in state.items() if k.startswith("llm.")}, text, None):
        hf["lm_head.weight" if key == "lm_head.weight" else "model.language_model." + key[len("model.") :]] = tensor
    result = model.load_state_dict(hf, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


@pytest.mark.parametrize("raw", [False, True], ids=["template", "raw"])
def test_greedy_generation_equals_transformers_left_padded(tmp_path, raw):
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((40, 30), (25, 50))]
    items = [("compare <image> and <image> please, then say which is larger.", images), ("<image>\nwhat is it?",
             images[:1]), ("say hi.", [])]  # fmt: skip
    with one_thread():
        ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip", extra=MODEL)
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=12), raw=raw)
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        cfg, pad = answerer.model.cfg, answerer.generation.pad_token_id
        hf = _hf_llava(cfg, answerer.model.state_dict(), pad)
        width = max(len(p.ids) for p in prepared)
        ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in prepared])
        mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prepared])
        pixels = torch.cat([p.pixels for p in prepared if p.pixels is not None])
        pixels = normalize_pixels(pixels, cfg.vision.image_mean, cfg.vision.image_std)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=12,
                              do_sample=False, eos_token_id=None, pad_token_id=pad)  # fmt: skip
    assert max(len(p.ids) for p in prepared) + 12 > 2 * 16  # decoding crosses chunk boundaries
    assert ours == out[:, width:].tolist()
