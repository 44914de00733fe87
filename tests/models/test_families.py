"""Decoder families against transformers' own classes (tiny random llava-hf models, fp32, CPU): Llama-3 (tied
embeddings, llama3 RoPE, HF attention_bias / mlp_bias), Mistral (sliding window 8, explicit head_dim), Qwen2
(q/k/v biases, tied embeddings) and Qwen3 (q / k norms, explicit head_dim). Per family: whole-model logits (unpacked and packed rows longer than the window),
greedy generation with the KV cache on a left-padded batch, and export → reload in transformers 5."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlavaForConditionalGeneration, MistralConfig, Qwen2Config, Qwen3Config

from neva.checkpoint.hf_config import llm_config_from_hf
from neva.checkpoint.hf_export import save_llava_hf
from neva.models.media import image_media
from neva.models.neva import NevaModel
from tests.checkpoint.tiny_hf import one_thread
from tests.hf_oracle import neva_from_hf, tiny_llava
from tests.models.test_generation import hf_greedy, ours_greedy, prompt
from tests.models.test_hf_parity import image_prompt, rel_err

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
FAMILIES = {
    "llama3_tied": (LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama_biases": (LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "mistral_window": (MistralConfig, dict(sliding_window=8, head_dim=16)),  # head_dim != hidden / heads (12)
    "qwen2_tied": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3_norms": (Qwen3Config, dict(head_dim=16)),  # q / k norms, head_dim != hidden / heads
}
WINDOW = 8


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    cls, extra = FAMILIES[request.param]
    hf = tiny_llava(seed=3, text_kw=extra, text_cls=cls, tie_word_embeddings=extra.get("tie_word_embeddings", False))
    return request.param, hf, neva_from_hf(hf)


def test_config_names_the_family(family):
    name, hf, ours = family
    llm = ours.cfg.llm
    assert llm.family == hf.config.text_config.model_type
    assert llm.tie_word_embeddings == name.endswith("_tied")
    assert llm.sliding_window == (WINDOW if name == "mistral_window" else None)
    assert llm.qk_norm == (name == "qwen3_norms")
    assert (llm.qkv_bias, llm.o_bias, llm.mlp_bias) == {
        "llama_biases": (True, True, True),
        "qwen2_tied": (True, False, False),
    }.get(name, (False, False, False))
    if llm.tie_word_embeddings:
        assert ours.llm.output.weight is ours.llm.tok_embeddings.weight


def test_logits_match_hf_unpacked_and_packed(family):
    name, hf, ours = family
    cfg = ours.cfg
    a = image_prompt(cfg.num_image_tokens, cfg.image_token_id, 1, 9, seed=1)  # 28 tokens > the window
    b = torch.randint(0, cfg.image_token_id - 1, (13,), generator=torch.Generator().manual_seed(2))
    pixels = torch.randn(1, 3, 28, 28)
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())])[None]
    segments = torch.cat([torch.full_like(a, 1), torch.full_like(b, 2)])[None]
    with torch.no_grad():
        exp_a, exp_b = hf(input_ids=a[None], pixel_values=pixels).logits[0], hf(input_ids=b[None]).logits[0]
        assert rel_err(ours(a[None], image_media(pixels))[0], exp_a) < 1e-5
        got = ours(packed, image_media(pixels), position_ids=positions, segment_ids=segments)[0]
        if name == "mistral_window":  # the window really is exercised: attending past it is another function
            unwindowed = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, sliding_window=None))
            full = NevaModel(unwindowed).eval()
            full.load_state_dict(ours.state_dict())
            assert rel_err(full(a[None], image_media(pixels))[0], exp_a) > 1e-3
    assert rel_err(got[: a.numel()], exp_a) < 1e-5
    assert rel_err(got[a.numel() :], exp_b) < 1e-5


def test_greedy_generation_matches_hf_left_padded(family):
    _, hf, ours = family
    prompts = [prompt(ours.cfg, 1, 9, seed=1), prompt(ours.cfg, 0, 12, seed=2)]  # 29 and 13 tokens
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    assert ours_greedy(ours, prompts, pixels, [1, 0]) == hf_greedy(hf, prompts, pixels)


def test_export_reloads_in_transformers_with_identical_logits(family, tmp_path):
    _, hf, ours = family
    out = save_llava_hf(tmp_path / "hf", ours.cfg, ours.state_dict())
    reloaded = LlavaForConditionalGeneration.from_pretrained(str(out)).eval()
    text = reloaded.config.text_config
    assert text.model_type == hf.config.text_config.model_type
    assert text.tie_word_embeddings == ours.cfg.llm.tie_word_embeddings
    assert llm_config_from_hf(text.to_dict()) == ours.cfg.llm
    ids = image_prompt(ours.cfg.num_image_tokens, ours.cfg.image_token_id, 1, 9, seed=5)[None]
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(
            reloaded(input_ids=ids, pixel_values=pixels).logits, hf(input_ids=ids, pixel_values=pixels).logits
        )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="qwen2_moe"), "'qwen2_moe' is not supported yet"),
        (dict(model_type="gemma"), "'gemma' is not supported yet"),
        (dict(model_type="falcon"), "'falcon' is not a supported decoder family"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window=True"),
        (dict(model_type="qwen2", layer_types=["sliding_attention"] * 2), "layer_types="),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1"),
        (dict(model_type="mistral", attention_bias=True), "attention_bias=True .unknown to neva"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config="),
    ],
)
def test_fields_neva_would_not_honour_are_refused_by_name(fields, message):
    hf = {**LlamaConfig(num_hidden_layers=2).to_dict(), **fields}
    if hf["model_type"] == "qwen2":
        hf = {**Qwen2Config(num_hidden_layers=2).to_dict(), **fields}
    with pytest.raises(ValueError, match=message):
        llm_config_from_hf(hf)


def test_lora_leaves_biases_frozen_and_merges_them_as_they_are(family):
    """LoRA adapts the weights only: a biased layer's bias stays frozen under the adapter, and the merged state dict
    names it plainly (what the export and the HF tables read)."""
    import copy

    from neva.models.lora import apply_lora, merged_state_dict
    from neva.models.trainable import LoraSpec, TrainablePolicy, apply_policy

    _, _, ours = family
    model = copy.deepcopy(ours)
    apply_lora(model, ["wq", "wk", "wv", "wo"], rank=2, alpha=4.0, dropout=0.0)
    apply_policy(model, TrainablePolicy(lora=LoraSpec(2, 4.0, 0.0, ("wq", "wk", "wv", "wo"))))
    biases = [n for n, p in model.named_parameters() if n.endswith("bias") and n.startswith("llm.")]
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in biases)
    assert bool(biases) == (ours.cfg.llm.qkv_bias or ours.cfg.llm.o_bias)
    assert set(merged_state_dict(model)) == set(ours.state_dict())
