"""The FLOP count of ``neva.models.flops`` against counts made by hand for a small model, matmul by matmul."""

import pytest

from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.models.flops import SampleFlops, device_peak_tflops
from neva.models.trainable import LoraSpec, TrainablePolicy, build_meta_model


def small_config(tie: bool = False) -> NevaConfig:
    llm = LLMConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=128,
        tie_word_embeddings=tie,
    )
    # 16 px in 4 px patches: 16 patches (+ CLS = 17 ViT tokens); layer -2 of 3 selected, so 2 layers run.
    vision = VisionConfig(image_size=16, patch_size=4, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=4)
    projector = ProjectorConfig(type="mlp2x_gelu", input_size=24, output_size=32)
    return NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=95)


S = 40  # LLM positions of the sample: 16 image tokens + 24 text tokens
# Matmul weights by hand. Decoder layer: wq 32x32, wk 32x16, wv 32x16, wo 32x32, w1 / w3 32x48, w2 48x32.
QKV, WO, MLP = 1024 + 512 + 512, 1024, 3 * 1536
LAYER = QKV + WO + MLP  # 7680
HEAD = 96 * 32
CORE = 4 * S * S * 32  # per decoder layer forward: 4·S·S·(heads × head dim)
# LoRA rank 2: lora_a is 2 x in, lora_b is out x 2 for each of the 7 Linears.
LORA_QKV_A, LORA_QKV_B = 3 * 2 * 32, 2 * 32 + 2 * 16 + 2 * 16
LORA_REST = (2 * 32 + 32 * 2) + 2 * (2 * 32 + 48 * 2) + (2 * 48 + 32 * 2)  # wo, w1 + w3, w2
LORA_LAYER = LORA_QKV_A + LORA_QKV_B + LORA_REST  # 928
# Projector: 24 -> 32 and 32 -> 32 over 16 image tokens.
PROJ0, PROJ2, IMAGE_TOKENS = 24 * 32, 32 * 32, 16
# ViT: the patch convolution (3·4·4 → 24) over 16 patches; per layer q, k, v, o 24x24 and fc1 / fc2 24x40 over 17
# tokens, plus the core 4·17·17·24; 2 layers run.
PATCH = 3 * 4 * 4 * 24 * 16
VIT_LAYER = (4 * 24 * 24 + 2 * 24 * 40) * 17
VIT_CORE = 4 * 17 * 17 * 24
VISION_FORWARD = 2 * PATCH + 2 * 2 * VIT_LAYER + 2 * VIT_CORE

LORA = LoraSpec(rank=2, alpha=4.0, dropout=0.0, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))

# policy -> hand count for one sample of S positions with one image
CASES = {
    # Frozen decoder under the trained projector: forward + input gradient (4 per weight), attention ×3; the first
    # projector Linear reads the frozen tower's output (no input gradient: 4), the second needs one (6).
    "pretrain": (
        TrainablePolicy(),
        S * 4 * (2 * LAYER + HEAD) + 3 * 2 * CORE + IMAGE_TOKENS * (4 * PROJ0 + 6 * PROJ2) + VISION_FORWARD,
    ),
    "finetune": (
        TrainablePolicy(llm=True),
        S * 6 * (2 * LAYER + HEAD) + 3 * 2 * CORE + IMAGE_TOKENS * (4 * PROJ0 + 6 * PROJ2) + VISION_FORWARD,
    ),
    "lora": (
        TrainablePolicy(lora=LORA),
        S * (4 * (2 * LAYER + HEAD) + 6 * 2 * LORA_LAYER)
        + 3 * 2 * CORE
        + IMAGE_TOKENS * (4 * PROJ0 + 6 * PROJ2)
        + VISION_FORWARD,
    ),
    # Nothing trains before layer 0's q/k/v adapters: there the frozen bases run forward only (2) and the lora_a
    # factors need no input gradient (4); everything after them needs input gradients.
    "lora_frozen_projector": (
        TrainablePolicy(projector=False, lora=LORA),
        S * (2 * QKV + 4 * LORA_QKV_A + 6 * LORA_QKV_B + 4 * (WO + MLP) + 6 * LORA_REST)
        + S * (4 * LAYER + 6 * LORA_LAYER + 4 * HEAD)
        + 3 * 2 * CORE
        + IMAGE_TOKENS * 2 * (PROJ0 + PROJ2)
        + VISION_FORWARD,
    ),
    # A trained tower: the patch convolution reads pixels (no input gradient: 4), every later matmul costs 6.
    "vision": (
        TrainablePolicy(vision=True),
        S * 4 * (2 * LAYER + HEAD)
        + 3 * 2 * CORE
        + IMAGE_TOKENS * 6 * (PROJ0 + PROJ2)
        + 4 * PATCH
        + 2 * 6 * VIT_LAYER
        + 2 * 3 * VIT_CORE,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sample_flops_match_a_hand_count(case):
    policy, expected = CASES[case]
    flops = SampleFlops.of(build_meta_model(small_config(), policy))
    assert flops.sample(S, 1) == expected


def test_text_only_samples_and_batches():
    flops = SampleFlops.of(build_meta_model(small_config(), TrainablePolicy(llm=True)))
    text_only = S * 6 * (2 * LAYER + HEAD) + 3 * 2 * CORE
    assert flops.sample(S, 0) == text_only
    assert flops.batch([S, 7, S], 2) == flops.sample(S, 1) + flops.sample(7, 0) + flops.sample(S, 1)


def test_tied_lm_head_costs_what_an_untied_one_does():
    for policy in (TrainablePolicy(), TrainablePolicy(llm=True)):
        tied = SampleFlops.of(build_meta_model(small_config(tie=True), policy))
        untied = SampleFlops.of(build_meta_model(small_config(), policy))
        assert tied == untied


def test_peak_table():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H200") == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", configured=100.0) == 100.0  # the configured value wins
    assert device_peak_tflops(None, configured=5.0) == 5.0
    assert device_peak_tflops("Some Other GPU") is None
    assert device_peak_tflops(None) is None


def test_siglip_tower_and_mlp_downsample_count_their_own_tokens():
    """SigLIP: 16 ViT tokens (no CLS) in every block; mlp_downsample: its Linears (4·24 → 32, 32 → 32) over the 4
    merged tokens, which are also the sample's image positions (4 + 24 text = 28); both cost 6 per weight, since
    the LayerNorm in front of them trains."""
    import dataclasses

    cfg = small_config()
    vision = dataclasses.replace(cfg.vision, kind="siglip", hidden_act="gelu_pytorch_tanh")
    projector = dataclasses.replace(cfg.projector, type="mlp_downsample")
    cfg = dataclasses.replace(cfg, vision=vision, projector=projector)
    assert cfg.num_image_tokens == 4
    s = 4 + 24
    vit_layer, vit_core = (4 * 24 * 24 + 2 * 24 * 40) * 16, 4 * 16 * 16 * 24
    expected = (
        s * 4 * (2 * LAYER + HEAD)
        + 3 * 2 * 4 * s * s * 32
        + 4 * 6 * (96 * 32 + 32 * 32)  # the trained LayerNorm before the first Linear: it needs input gradients
        + 2 * PATCH + 2 * 2 * vit_layer + 2 * vit_core
    )  # fmt: skip
    assert SampleFlops.of(build_meta_model(cfg, TrainablePolicy())).sample(s, 1) == expected


def test_sliding_window_counts_the_band_and_biases_no_flops():
    """A window of 8: the core's square counts the pairs each query sees (8² for the first 8, 2·8 per later query),
    exactly as the attention computes them; q/k/v biases add parameters but no matmul."""
    import dataclasses

    cfg = small_config()
    windowed = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, sliding_window=8, qkv_bias=True))
    policy = TrainablePolicy(llm=True)
    full, band = (SampleFlops.of(build_meta_model(c, policy)) for c in (cfg, windowed))
    assert (band.per_token, band.per_token2) == (full.per_token, full.per_token2)
    assert band.sample(S, 1) - full.sample(S, 1) == full.per_token2 * ((8 * 8 + 2 * 8 * (S - 8)) - S * S)
    assert band.sample(8, 0) == full.sample(8, 0)  # within the window nothing changes


def test_video_frames_count_a_tower_pass_and_the_projector_over_pooled_tokens():
    """A video of 3 frames, 2×2-pooled (16 patches → 4 tokens a frame): each frame one tower pass, the projector
    over its 4 pooled tokens; the 12 video positions are decoder positions like any other (12 + 24 text = 36)."""
    import dataclasses

    from neva.models.video import VideoConfig

    cfg = dataclasses.replace(small_config(), video=VideoConfig(spatial_pool_stride=2))
    assert cfg.video_tokens(3) == 12
    s = 12 + 24
    expected = (
        s * 4 * (2 * LAYER + HEAD)
        + 3 * 2 * 4 * s * s * 32
        + 3 * (4 * (4 * PROJ0 + 6 * PROJ2) + VISION_FORWARD)
    )  # fmt: skip
    flops = SampleFlops.of(build_meta_model(cfg, TrainablePolicy()))
    assert flops.batch([s], 0, frames=3) == expected
    assert flops.batch([S], 1) == CASES["pretrain"][1]  # images count as before
