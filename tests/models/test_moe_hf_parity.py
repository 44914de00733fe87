"""The MoE decoder against transformers' Mixtral (fp32, CPU, tiny random configs): logits, router choices, the two
load-balancing losses, greedy generation with the KV cache."""

import dataclasses

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from neva.checkpoint.hf_config import llm_config_from_hf
from neva.checkpoint.hf_moe import canonical_tensors, expert_groups
from neva.models.generation import GenerationConfig, generate
from neva.models.llama import LlamaDecoder
from neva.models.media import image_media
from neva.models.moe import MoEFeedForward, aux_objective, load_balancing_loss, moe_layers, z_loss
from tests.checkpoint.tiny_hf import one_thread
from tests.hf_oracle import neva_from_hf, randomise_inits
from tests.models.test_hf_parity import load_part, rel_err
from tests.models.tiny_mixtral import MIXTRAL_KW, tiny_mixtral_llava


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(**MIXTRAL_KW, output_router_logits=True, router_aux_loss_coef=0.02)).eval()
    randomise_inits(hf)
    ours = LlamaDecoder(llm_config_from_hf(hf.config.to_dict())).eval()
    sd = hf.state_dict()
    load_part(ours, dict(canonical_tensors(sd.items(), expert_groups(sd))), "llm")
    return hf, ours


def switch_loss_megatron(router_logits: tuple, mask: torch.Tensor, e: int, k: int) -> torch.Tensor:
    """Megatron-Core's ``switch_load_balancing_loss_func`` per layer (its padding_mask path), summed over layers."""
    total = 0.0
    keep = mask.reshape(-1).bool()
    for logits in router_logits:
        probs = torch.softmax(logits[keep].float(), dim=-1)
        routing_map = torch.zeros_like(probs).scatter_(1, probs.topk(k, dim=-1).indices, 1.0)
        tokens_per_expert = routing_map.sum(0)
        t = keep.sum()
        total = total + (probs.sum(0) * tokens_per_expert).sum() * (e / (k * t * t))
    return total


def test_logits_router_choices_and_aux_losses_match_mixtral(mixtral):
    hf, ours = mixtral
    e, k = MIXTRAL_KW["num_local_experts"], MIXTRAL_KW["num_experts_per_tok"]
    ids = torch.randint(0, MIXTRAL_KW["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: no load-balancing statistic counts it, in either source
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, labels=ids)
        got = ours(ours.tok_embeddings(ids), token_mask=mask.bool())
    real = mask.bool()
    assert rel_err(got[real], out.logits[real]) < 1e-5
    stats = [m.routing for m in moe_layers([ours])]
    flat_real = real.reshape(-1)
    for s, logits in zip(stats, out.router_logits):
        expected = torch.softmax(logits.float(), -1).topk(k, dim=-1).indices
        assert torch.equal(s.top_k_index[flat_real], expected[flat_real])
    cfg = ours.cfg
    hf_aux = load_balancing_loss_func(out.router_logits, e, k, mask)
    hf_cfg = dataclasses.replace(cfg, moe_aux_loss_formula="hf", moe_aux_loss_coeff=0.02)
    assert rel_err(load_balancing_loss(stats, hf_cfg), hf_aux) < 1e-6
    # HF's training loss is its token mean plus the coefficient times the aux loss; neva's objective term equals it.
    assert rel_err(aux_objective(stats, hf_cfg), 0.02 * out.aux_loss) < 1e-6
    mega = load_balancing_loss(stats, dataclasses.replace(cfg, moe_aux_loss_formula="megatron"))
    assert rel_err(mega, switch_loss_megatron(out.router_logits, mask, e, k)) < 1e-6
    # z-loss: Megatron-Core's per-layer mean of logsumexp(logits)^2 over the real tokens.
    expected_z = sum(torch.logsumexp(x[real.reshape(-1)], -1).square().mean() for x in out.router_logits)
    assert rel_err(z_loss(stats), expected_z) < 1e-6


def test_grouped_experts_equal_a_dense_sum_over_experts():
    """Sorting tokens by expert, running each group and adding back equals the per-token weighted sum."""
    torch.manual_seed(1)
    cfg = llm_config_from_hf({**MixtralConfig(**MIXTRAL_KW).to_dict()})
    layer = MoEFeedForward(cfg)
    layer.reset_parameters(0.2)
    x = torch.randn(3, 5, cfg.hidden_size)
    got = layer(x)
    _, _, weights, index = layer.router(x.reshape(-1, cfg.hidden_size))
    flat = x.reshape(-1, cfg.hidden_size)
    ex = layer.experts
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for slot in range(index.shape[1]):
            e = index[t, slot]
            y = ex.w2[e] @ (torch.nn.functional.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t]))
            expected[t] += weights[t, slot] * y
    assert rel_err(got.reshape(-1, cfg.hidden_size), expected) < 1e-6


def test_grouped_gemm_and_expert_loop_agree():
    """The two ways the experts run (torch's grouped GEMM where it has a kernel, the loop elsewhere): the same
    outputs and weight gradients, with an expert that receives no row."""
    from neva.models.moe import grouped_experts, looped_experts

    g = torch.Generator().manual_seed(2)
    e, h, i = 4, 16, 24
    weights = [torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)]
    x, counts = torch.randn(11, h, generator=g), torch.tensor([3, 0, 6, 2])
    results = []
    for run in (grouped_experts, looped_experts):
        params = [w.clone().requires_grad_() for w in weights]
        y = run(*params, x, counts)
        y.square().sum().backward()
        results.append([y.detach(), *(p.grad for p in params)])
    for got, expected in zip(*results):
        assert rel_err(got, expected) < 1e-6


def test_llava_mixtral_logits_and_greedy_generation_match_hf():
    hf = tiny_mixtral_llava(seed=3)
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    assert cfg.llm.num_moe_experts == MIXTRAL_KW["num_local_experts"]
    g = torch.Generator().manual_seed(0)
    ids = [1, *torch.randint(3, cfg.image_token_id - 1, (3,), generator=g).tolist()]
    ids += [cfg.image_token_id] * cfg.num_image_tokens + torch.randint(3, 90, (6,), generator=g).tolist()
    pixels = torch.randn(1, 3, 28, 28, generator=g)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
        got = ours(torch.tensor([ids]), image_media(pixels, torch.tensor([1])))
    assert rel_err(got, expected) < 1e-5
    new = 8
    hf_out = hf.generate(
        input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=new, do_sample=False, eos_token_id=None
    )[0, len(ids) :].tolist()
    ours_out = generate(ours, [ids], pixels, [1], GenerationConfig(max_new_tokens=new, pad_token_id=0))
    assert ours_out == [hf_out]
