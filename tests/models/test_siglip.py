"""SigLIP tower and NeMo's mlp_downsample projector against their references (fp32, CPU, tiny random configs).

The tower against transformers' ``SiglipVisionModel`` and a whole llava-hf ``LlavaForConditionalGeneration`` with a
SigLIP vision config (logits, greedy generation with the KV cache); ``mlp_downsample`` against NeMo NeVA's
``DownSampleBlock`` (``nemo/collections/nlp/modules/common/megatron/adapters/parallel_adapters.py``, before NeMo 1's
removal) rewritten below as it is written there.
"""

from __future__ import annotations

import pytest
import torch
from transformers import SiglipVisionConfig, SiglipVisionModel

from neva.checkpoint.hf_config import neva_config_from_llava, vision_config_from_hf
from neva.models.config import ProjectorConfig, VisionConfig
from neva.models.generation import GenerationConfig, generate
from neva.models.media import image_media
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.models.projector import build_projector
from neva.models.vision_siglip import SiglipTower
from tests.checkpoint.tiny_hf import one_thread
from tests.hf_oracle import SIGLIP_KW, neva_from_hf, randomise_inits, tiny_llava
from tests.models.test_hf_parity import image_prompt, load_part, rel_err


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def llava():
    hf = tiny_llava(seed=5, tower="siglip", vision_feature_layer=-1)
    return hf, neva_from_hf(hf)


def test_siglip_hidden_states_and_llava_features_match_transformers():
    torch.manual_seed(0)
    hf = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_KW)).eval()
    randomise_inits(hf)
    cfg = vision_config_from_hf(hf.config.to_dict(), select_layer=[-2, -1])
    assert (cfg.kind, cfg.hidden_act, cfg.layer_norm_eps, cfg.image_mean) == (
        "siglip", "gelu_pytorch_tanh", 1e-6, (0.5, 0.5, 0.5)
    )  # fmt: skip
    ours = SiglipTower(cfg)
    load_part(ours, {k: v for k, v in hf.state_dict().items() if not k.startswith("head.")}, "vision")
    pixels = torch.randn(2, 3, 35, 35)
    with torch.no_grad():
        out = hf(pixel_values=pixels, output_hidden_states=True)
        got = ours.hidden_states(pixels)
        features = ours.features(pixels)
    assert len(got) == len(out.hidden_states) == 4
    for g, e in zip(got, out.hidden_states):
        assert rel_err(g, e) < 1e-5
    # hidden_states[-1] is the last block before post_layernorm (what LLaVA reads); post_norm gives HF's last state
    assert rel_err(ours.post_norm(got[-1]), out.last_hidden_state) < 1e-5
    assert rel_err(got[-1], out.last_hidden_state) > 1e-2
    # no class token: "patch" keeps all 25 patches of every selected layer
    expected = torch.cat([out.hidden_states[-2], out.hidden_states[-1]], dim=-1)
    assert features.shape == (2, 25, 64) and rel_err(features, expected) < 1e-5


def test_llava_siglip_logits_match_transformers(llava):
    hf, ours = llava
    cfg = ours.cfg
    assert cfg.vision.kind == "siglip" and cfg.num_image_tokens == 25 == hf.config.image_seq_length
    pixels = torch.randn(2, 3, 35, 35, generator=torch.Generator().manual_seed(1))
    ids = torch.stack([image_prompt(25, cfg.image_token_id, 1, 9, seed) for seed in (0, 1)])
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
        got = ours(ids, image_media(pixels))
    assert rel_err(got, expected) < 1e-5


def test_llava_siglip_greedy_generation_matches_transformers(llava):
    hf, ours = llava
    from tests.models.test_generation import hf_greedy, ours_greedy, prompt

    prompts = [prompt(ours.cfg, 1, 5, 0), prompt(ours.cfg, 1, 2, 1)]
    pixels = torch.randn(2, 3, 35, 35, generator=torch.Generator().manual_seed(2))
    assert ours_greedy(ours, prompts, pixels) == hf_greedy(hf, prompts, pixels)


def test_llava_hf_default_strategy_on_siglip_is_refused():
    hf = tiny_llava(seed=0, tower="siglip", vision_feature_select_strategy="default")
    with pytest.raises(ValueError, match="vision_feature_select_strategy='default' on a siglip tower"):
        neva_config_from_llava(hf.config.to_dict())
    # what transformers does with it: one token fewer than the 25 patches
    with torch.no_grad():
        feats = hf.model.get_image_features(
            pixel_values=torch.randn(1, 3, 35, 35), vision_feature_layer=-2, vision_feature_select_strategy="default"
        ).pooler_output
    assert feats[0].shape[0] == 24


def test_unknown_tower_and_cls_patch_on_siglip_are_refused():
    with pytest.raises(ValueError, match=r"model_type='dinov2'.*supported: clip_vision_model \(clip\), siglip"):
        vision_config_from_hf({"model_type": "dinov2", "hidden_size": 32})
    with pytest.raises(ValueError, match=r"siglip2_vision_model.*NaFlex"):
        vision_config_from_hf({"vision_config": {"model_type": "siglip2_vision_model"}})
    with pytest.raises(ValueError, match="no class token"):
        VisionConfig(kind="siglip", hidden_act="gelu_pytorch_tanh", vision_select_feature="cls_patch")
    with pytest.raises(ValueError, match="siglip vision hidden_act must be gelu_pytorch_tanh"):
        VisionConfig(kind="siglip", hidden_act="quick_gelu")


# ----------------------------------------------------------------------------------------------- mlp_downsample


class NemoDownSampleBlock(torch.nn.Module):
    """NeMo NeVA's DownSampleBlock as written there (``[b, T, F, tokens, c]`` media tensors)."""

    def forward(self, x):
        vit_embeds = x
        h = w = int(vit_embeds.shape[3] ** 0.5)
        vit_embeds = vit_embeds.reshape(*vit_embeds.shape[:3], h, w, -1)
        vit_embeds = self.flat_square(vit_embeds)
        vit_embeds = vit_embeds.reshape(*vit_embeds.shape[:3], -1, vit_embeds.shape[-1])
        return vit_embeds

    def flat_square(self, x):
        b, T, F, h, w, c = x.size()
        if w % 2 == 1:
            x = torch.cat([x, torch.zeros((b, T, F, h, 1, c), dtype=x.dtype).to(x.device)], dim=4)
            b, T, F, h, w, c = x.size()
        if h % 2 == 1:
            x = torch.cat([x, torch.zeros((b, T, F, 1, w, c), dtype=x.dtype).to(x.device)], dim=3)
            b, T, F, h, w, c = x.size()
        x = x.view(b, T, F, h, int(w / 2), int(c * 2))
        x = x.permute(0, 1, 2, 4, 3, 5).contiguous()
        x = x.view(b, T, F, int(h / 2), int(w / 2), int(c * 4))
        return x


def nemo_mlp_downsample(in_features: int, out_features: int) -> torch.nn.Sequential:
    """NeMo's ``MultimodalProjectorAdapter('mlp_downsample', ...)`` module list."""
    return torch.nn.Sequential(
        NemoDownSampleBlock(),
        torch.nn.LayerNorm(in_features * 4),
        torch.nn.Linear(in_features * 4, out_features, True),
        torch.nn.GELU(),
        torch.nn.Linear(out_features, out_features, True),
    )


@pytest.mark.parametrize("grid", [4, 5], ids=["even", "odd"])
def test_mlp_downsample_equals_nemo(grid):
    torch.manual_seed(0)
    cfg = ProjectorConfig(type="mlp_downsample", input_size=6, output_size=10)
    ours = build_projector(cfg)
    ref = nemo_mlp_downsample(6, 10)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    assert ours.load_state_dict(ref.state_dict()) is not None  # NeMo's Sequential indices are neva's keys
    feats = torch.randn(3, grid * grid, 6)
    with torch.no_grad():
        expected = ref(feats[None, :, None])[0, :, 0]
        got = ours(feats)
    vision = VisionConfig(kind="siglip", hidden_act="gelu_pytorch_tanh", image_size=7 * grid, patch_size=7)
    assert got.shape == (3, cfg.num_tokens(vision), 10) == (3, ((grid + 1) // 2) ** 2, 10)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_mlp_downsample_token_count_reaches_the_model():
    so400m = build_config("llama2_7b", vision="siglip_so400m_384")
    assert so400m.vision.seq_len == so400m.num_image_tokens == 729  # 384 // 14 = 27 per side, no class token
    assert (
        build_config("llama2_7b", vision="siglip_so400m_384", projector_type="mlp_downsample").num_image_tokens == 196
    )
    cfg = build_config(vision="tiny_siglip", projector_type="mlp_downsample")
    assert cfg.vision.num_image_tokens == 16 and cfg.num_image_tokens == 4  # 4×4 grid → 2×2 merged tokens
    model = NevaModel(cfg)
    model.init_weights()
    ids = torch.tensor([[1, 2] + [cfg.image_token_id] * 4 + [3]])
    pixels = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    assert model(ids, image_media(pixels)).shape == (1, 7, cfg.llm.vocab_size)
    with pytest.raises(ValueError, match="cls_patch adds a class token"):
        build_config(vision={**dict(image_size=32, patch_size=8), "vision_select_feature": "cls_patch"},
                     projector_type="mlp_downsample")  # fmt: skip


def test_generation_with_mlp_downsample_uses_the_merged_token_count():
    torch.manual_seed(0)
    cfg = build_config(vision="tiny_siglip", projector_type="mlp_downsample")
    model = NevaModel(cfg).eval()
    model.init_weights()
    prompts = [[1, 5] + [cfg.image_token_id] * cfg.num_image_tokens + [7, 8]]
    pixels = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    out = generate(model, prompts, pixels, None, GenerationConfig(max_new_tokens=3))
    assert len(out[0]) == 3
