"""neva model numerics against transformers (fp32, CPU, tiny random configs)."""

import pytest
import torch
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.models.llama import LlamaDecoder
from neva.models.media import image_media
from neva.models.vision import VisionTower
from tests.hf_oracle import TEXT_KW, VISION_KW, neva_from_hf, tiny_llava


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def load_part(module: torch.nn.Module, hf_state: dict, part: str) -> None:
    prefixes = detect_prefixes(hf_state.keys(), parts=(part,))
    ours = {}
    for key, value in hf_state.items():
        neva = hf_key_to_neva(key, prefixes)
        if neva is not None:
            ours[neva.split(".", 1)[1]] = value
    module.load_state_dict(ours, strict=True)


def test_vision_hidden_states_match_clip():
    torch.manual_seed(0)
    hf = CLIPVisionModel(CLIPVisionConfig(**VISION_KW)).eval()
    ours = VisionTower(vision_config_from_hf(hf.config.to_dict()))
    load_part(ours, hf.state_dict(), "vision")
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = hf(pixel_values=pixels, output_hidden_states=True).hidden_states
        got = ours.hidden_states(pixels)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_llm_logits_match_llama(kv_heads):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TEXT_KW, "num_key_value_heads": kv_heads})).eval()
    ours = LlamaDecoder(llm_config_from_hf(hf.config.to_dict()))
    load_part(ours, hf.state_dict(), "llm")
    ids = torch.randint(0, TEXT_KW["vocab_size"], (2, 17))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ours.tok_embeddings(ids))
    assert rel_err(got, expected) < 1e-5


def test_llm_rope_scaling_matches_llama3():
    torch.manual_seed(0)
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    hf = LlamaForCausalLM(LlamaConfig(**TEXT_KW, rope_parameters={"rope_theta": 500000.0, **scaling})).eval()
    cfg = llm_config_from_hf(hf.config.to_dict())
    assert cfg.rope_scaling["rope_type"] == "llama3"
    ours = LlamaDecoder(cfg)
    load_part(ours, hf.state_dict(), "llm")
    ids = torch.randint(0, TEXT_KW["vocab_size"], (1, 40))
    with torch.no_grad():
        assert rel_err(ours(ours.tok_embeddings(ids)), hf(input_ids=ids).logits) < 1e-5


def image_prompt(n_tokens: int, image_token: int, n_images: int, text_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(n_images):
        parts += [torch.randint(0, image_token - 1, (3,), generator=g), torch.full((n_tokens,), image_token)]
    parts.append(torch.randint(0, image_token - 1, (text_len,), generator=g))
    return torch.cat(parts)


def test_llava_logits_match_hf():
    hf = tiny_llava()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    ids = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 1, 9, seed=1)[None]
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
        got = ours(ids, image_media(pixels))
    assert rel_err(got, expected) < 1e-5


def test_llava_two_images_and_text_only_row_in_one_batch():
    hf = tiny_llava()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    row0 = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 2, 5, seed=2)
    row1 = torch.randint(0, cfg.image_token_id - 1, (row0.numel(),))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        got = ours(torch.stack([row0, row1]), image_media(pixels, torch.tensor([2, 0])))
        exp0 = hf(input_ids=row0[None], pixel_values=pixels).logits[0]
        exp1 = hf(input_ids=row1[None]).logits[0]
    assert rel_err(got[0], exp0) < 1e-5
    assert rel_err(got[1], exp1) < 1e-5


def test_image_count_mismatch_names_the_sample():
    hf = tiny_llava()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    good = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 1, 4, seed=3)
    bad = good.clone()
    bad[5] = 1  # one image position overwritten by text
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\]"):
        ours(torch.stack([good, bad]), image_media(torch.randn(2, 3, 28, 28), torch.tensor([1, 1])))
    with pytest.raises(ValueError, match="no images"):
        ours(good[None])


def test_packed_segments_equal_separate_samples():
    hf = tiny_llava()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    a = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 1, 6, seed=4)
    b = torch.randint(0, cfg.image_token_id - 1, (11,))
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())])[None]
    segments = torch.cat([torch.full_like(a, 1), torch.full_like(b, 2)])[None]
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        got = ours(packed, image_media(pixels), position_ids=positions, segment_ids=segments)[0]
        exp_a = ours(a[None], image_media(pixels))[0]
        exp_b = ours(b[None])[0]
    assert rel_err(got[: a.numel()], exp_a) < 1e-5
    assert rel_err(got[a.numel() :], exp_b) < 1e-5


def test_kv_cache_decoding_equals_full_recompute():
    hf = tiny_llava()
    ours = neva_from_hf(hf)
    ids = torch.randint(0, ours.cfg.image_token_id - 1, (2, 12))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(2, 16)
        prefix = ours(ids[:, :8], cache=cache)
        steps = [ours(ids[:, t : t + 1], cache=cache) for t in range(8, 12)]
    assert rel_err(prefix, full[:, :8]) < 1e-5
    assert rel_err(torch.cat(steps, dim=1), full[:, 8:]) < 1e-5


def test_generated_image_token_is_text_as_in_transformers():
    """A model whose greedy choice is its own image token (llava-hf gives it a vocabulary row): transformers embeds
    the generated token and goes on; neva's decoding did the same instead of refusing the next step (issue 52)."""
    from neva.models.generation import GenerationConfig, generate

    hf = tiny_llava()
    cfg = neva_from_hf(hf).cfg
    ids = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 1, 6, seed=4)[None]
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        first = hf(input_ids=ids, pixel_values=pixels).logits[0, -1]
        # the image token's row: three times the first choice's, so the image token is generated first
        hf.lm_head.weight[cfg.image_token_id] = 3 * hf.lm_head.weight[first.argmax()]
        assert first[first.argmax()] > 0
        want = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=4, do_sample=False, eos_token_id=None)
        want = want[0, ids.shape[1] :].tolist()
        assert want[0] == cfg.image_token_id
        got = generate(neva_from_hf(hf), [ids[0].tolist()], pixels, [1], GenerationConfig(max_new_tokens=4))
    assert got[0] == want
