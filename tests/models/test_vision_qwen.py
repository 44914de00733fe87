"""The native-resolution Qwen towers and their mergers against transformers' own vision models (fp32, CPU, tiny
random configs): Qwen2-VL, Qwen2.5-VL (window attention and a full-attention block) and Qwen3-VL (learned positions
resampled per grid, DeepStack), loaded through ``neva.checkpoint.hf_qwen_vl_keys``, on one call holding images of
different grids and a video (t > 1)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLVisionModel

from neva.checkpoint.hf_qwen_vl_keys import state_dict_from_hf, state_dict_to_hf
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.models.projector import build_projector, init_projector
from neva.models.towers import build_tower
from neva.models.vision import reaches_features
from tests.checkpoint.tiny_hf import one_thread
from tests.hf_oracle import randomise_inits
from tests.models.test_hf_parity import rel_err

COMMON = dict(patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=2)
# Per family: HF vision config class, vision model, whole-model classes, HF config fields, neva VisionConfig fields.
FAMILIES = {
    "qwen2_vl": (
        Qwen2VLVisionConfig,
        Qwen2VisionTransformerPretrainedModel,
        (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        dict(depth=2, embed_dim=32, hidden_size=48, mlp_ratio=2, hidden_act="quick_gelu"),
        dict(num_layers=2, intermediate_size=64, hidden_act="quick_gelu"),
    ),
    "qwen2_5_vl": (
        Qwen2_5_VLVisionConfig,
        Qwen2_5_VisionTransformerPretrainedModel,
        (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        # window 32 px = 4 merge units of 2 × 4-px patches: the 12 × 16 image has 2 × 2 windows, two cut short
        dict(
            depth=3,
            hidden_size=32,
            out_hidden_size=48,
            intermediate_size=40,
            window_size=32,
            fullatt_block_indexes=[1],
            hidden_act="silu",
        ),
        dict(num_layers=3, intermediate_size=40, window_size=32, fullatt_block_indexes=[1], hidden_act="silu"),
    ),
    "qwen3_vl": (
        Qwen3VLVisionConfig,
        Qwen3VLVisionModel,
        (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
        dict(
            depth=3,
            hidden_size=32,
            out_hidden_size=48,
            intermediate_size=40,
            num_position_embeddings=36,
            deepstack_visual_indexes=[0, 2],
            hidden_act="gelu_pytorch_tanh",
        ),
        dict(
            num_layers=3,
            intermediate_size=40,
            num_position_embeddings=36,
            deepstack_visual_indexes=[0, 2],
            hidden_act="gelu_pytorch_tanh",
        ),
    ),
}
GRID = torch.tensor([[1, 12, 16], [1, 4, 8], [3, 8, 4]])  # two images and a 3-temporal-patch video


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def neva_configs(kind: str) -> tuple[VisionConfig, ProjectorConfig]:
    fields = FAMILIES[kind][4]
    vision = VisionConfig(kind=kind, patch_size=4, hidden_size=32, num_heads=2, **fields)
    projector = ProjectorConfig(
        type=f"{kind}_merger", input_size=32, output_size=48, deepstack_mergers=len(vision.deepstack_visual_indexes)
    )
    return vision, projector


def hf_vision(kind: str, seed: int):
    """HF's vision model with weights of unit-scale activations (HF's 0.02 init would leave the blocks' and the
    positions' share of the output below the tolerance), norms and biases randomised."""
    config_cls, model_cls, _, fields, _ = FAMILIES[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **fields)).eval()
    randomise_inits(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(std=1.0 if "pos_embed" in name else p[0].numel() ** -0.5)
    return model


def neva_pair(kind: str, hf_state: dict):
    vision_cfg, projector_cfg = neva_configs(kind)
    tower, projector = build_tower(vision_cfg), build_projector(projector_cfg)
    state = state_dict_from_hf({"model.visual." + k: t for k, t in hf_state.items()}, kind)
    tower.load_state_dict({k[7:]: t for k, t in state.items() if k.startswith("vision.")})
    projector.load_state_dict({k[10:]: t for k, t in state.items() if k.startswith("projector.")})
    return tower, projector


def hf_normalised(pixels: torch.Tensor, cfg: VisionConfig) -> torch.Tensor:
    """What the HF processor hands the model: ``x / 255`` normalised per channel (the channel is the outer third)."""
    x = pixels.double().div(255).view(pixels.shape[0], 3, -1)
    mean, std = torch.tensor(cfg.image_mean, dtype=torch.double), torch.tensor(cfg.image_std, dtype=torch.double)
    return ((x - mean[:, None]) / std[:, None]).view(pixels.shape).float()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_tower_and_merger_match_transformers(kind):
    hf = hf_vision(kind, seed=3)
    tower, projector = neva_pair(kind, hf.state_dict())
    patches = int(GRID.prod(1).sum())
    torch.manual_seed(0)
    pixels = torch.randint(0, 256, (patches, tower.cfg.patch_dim), dtype=torch.uint8)
    with torch.no_grad():
        ref = hf(hidden_states=hf_normalised(pixels, tower.cfg), grid_thw=GRID)
    out = projector(tower.features(pixels, GRID))
    assert out.main.shape == (patches // 4, 48)
    assert rel_err(out.main.detach(), ref.pooler_output) <= 1e-5
    if kind == "qwen3_vl":
        assert len(out.deepstack) == 2
        for mine, theirs in zip(out.deepstack, ref.deepstack_features):
            assert rel_err(mine.detach(), theirs) <= 1e-5
    else:
        assert out.deepstack == []
    (out.main.square().sum() + sum(d.square().sum() for d in out.deepstack)).backward()
    for name, p in [*tower.named_parameters(), *projector.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_empty_input_gives_zero_rows_and_zero_gradients(kind):
    """A rank without images runs the tower on ``empty_input`` (freshly initialised: ``init_weights``)."""
    vision_cfg, projector_cfg = neva_configs(kind)
    tower, projector = build_tower(vision_cfg), build_projector(projector_cfg)
    tower.init_weights()
    init_projector(projector)
    out = projector(tower.features(tower.empty_input(torch.device("cpu")), torch.zeros(0, 3, dtype=torch.long)))
    assert out.main.shape == (0, 48) and all(d.shape == (0, 48) for d in out.deepstack)
    (out.main.sum() + sum(d.sum() for d in out.deepstack)).backward()
    for name, p in [*tower.named_parameters(), *projector.named_parameters()]:
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_key_table_covers_the_whole_visual_module_both_ways(kind):
    """Every ``model.visual.*`` tensor of a real (tiny) ``…ForConditionalGeneration`` has a neva name, every neva
    tower and merger tensor an HF one, and the round trip gives the same keys back (the 4.x ``visual.`` prefix too)."""
    _, _, (whole_config, whole_cls), fields, _ = FAMILIES[kind]
    text = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=24)  # fmt: skip
    if kind != "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}
    with torch.device("meta"):
        model = whole_cls(whole_config(vision_config={**COMMON, **fields}, text_config=text))
    visual = {k: t for k, t in model.state_dict().items() if k.startswith("model.visual.")}
    neva = state_dict_from_hf(visual, kind)
    vision_cfg, projector_cfg = neva_configs(kind)
    with torch.device("meta"):
        expected = {f"vision.{k}" for k in build_tower(vision_cfg).state_dict()}
        expected |= {f"projector.{k}" for k in build_projector(projector_cfg).state_dict()}
    assert set(neva) == expected
    assert all(neva[k].shape == t.shape for k, t in state_dict_from_hf(visual, kind).items())
    assert set(state_dict_to_hf(neva, kind)) == set(visual)
    legacy = state_dict_to_hf(neva, kind, prefix="visual.")
    assert set(state_dict_from_hf(legacy, kind)) == expected
    with pytest.raises(KeyError, match="not a"):
        state_dict_from_hf({"model.visual.unknown.weight": torch.zeros(1)}, kind)


def test_native_kinds_config_rules():
    """``is_native`` is the capability; fixed per-image counts refuse a native kind; CLIP / SigLIP keep their defaults;
    a native tower takes its own merger with the same merge and DeepStack counts; every block reaches the features."""
    vision, projector = neva_configs("qwen3_vl")
    assert vision.spec.patch_grid and not VisionConfig().spec.patch_grid and not VisionConfig(kind="siglip",
        hidden_act="gelu_pytorch_tanh").spec.patch_grid  # fmt: skip
    assert (vision.vision_select_layer, vision.layer_norm_eps) == (-1, 1e-6)
    assert (VisionConfig().vision_select_layer, VisionConfig().layer_norm_eps) == (-2, 1e-5)
    for prop in ("grid", "num_patches", "seq_len", "num_image_tokens"):
        with pytest.raises(ValueError, match="native resolution"):
            getattr(vision, prop)
    with pytest.raises(ValueError, match="native resolution"):
        projector.num_tokens(vision)
    with pytest.raises(ValueError, match="vision_select_layer must be -1"):
        VisionConfig(kind="qwen2_vl", hidden_size=32, num_heads=2, vision_select_layer=-2)
    llm = LLMConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=2)
    NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=63)
    wrong = ProjectorConfig(type="qwen2_vl_merger", input_size=32, output_size=48)
    with pytest.raises(ValueError, match="do not go together"):
        NevaConfig(llm=llm, vision=vision, projector=wrong, image_token_id=63)
    with pytest.raises(ValueError, match="deepstack_mergers"):
        NevaConfig(llm=llm, vision=vision, projector=ProjectorConfig(type="qwen3_vl_merger", input_size=32,
                   output_size=48), image_token_id=63)  # fmt: skip
    with torch.device("meta"):
        names = [n for n, _ in build_tower(vision).named_parameters()]
    assert all(reaches_features(vision, n) for n in names)
