"""The MoE routers' objective reaches the engine's step loss and gradients as documented (one process, CPU):
cross-entropy over the global batch's learned tokens + the mean over micro-batches of Megatron-Core's load-balancing
and z-losses over each micro-batch's real tokens (padding excluded), against a plain recomputation."""

import copy

import torch

from neva.models.loss import token_cross_entropy
from neva.models.moe import Router
from tests.models.test_moe_hf_parity import switch_loss_megatron
from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine

MOE = [
    "model.mm_cfg.llm.freeze=false",
    "model.data.conv_template=vicuna_v1",
    "+model.mm_cfg.llm.arch_overrides.num_moe_experts=4",
    "+model.mm_cfg.llm.arch_overrides.moe_aux_loss_coeff=0.5",
    "+model.mm_cfg.llm.arch_overrides.moe_z_loss_coeff=0.01",
]


def reference_objective(model, batches, cfg) -> torch.Tensor:
    """Full logits and router logits from hooks, the objective written out from the documented formulas."""
    router_logits = []
    hooks = [m.register_forward_hook(lambda m, i, o: router_logits.append(o[0])) for m in model.modules()]
    hooks = [h for h, m in zip(hooks, model.modules()) if isinstance(m, Router) or h.remove()]
    ce, tokens, aux = 0.0, 0, 0.0
    for mb in batches:
        router_logits.clear()
        logits = model(
            mb.input_ids,
            media=mb.media,
            position_ids=mb.position_ids,
            segment_ids=mb.segment_ids,
        )
        loss, n = token_cross_entropy(logits, mb.labels)
        ce, tokens = ce + loss, tokens + n
        real = (mb.segment_ids != 0).reshape(-1)
        lb = switch_loss_megatron(tuple(router_logits), real, cfg.num_moe_experts, cfg.moe_router_topk)
        z = sum(torch.logsumexp(x[real].float(), -1).square().mean() for x in router_logits)
        aux = aux + cfg.moe_aux_loss_coeff * lb + cfg.moe_z_loss_coeff * z
    for h in hooks:
        h.remove()
    return ce / tokens + aux / len(batches)


def test_router_objective_joins_the_step_loss_and_gradients(lean_cfg):
    cfg = lean_cfg(*MOE)
    source, batches = micro_batches(cfg, 2, 4)
    assert any((mb.segment_ids == 0).any() for mb in batches)  # padding present, and excluded
    engine = make_engine(cfg, source)
    reference = copy.deepcopy(engine.model)
    total, _ = engine.forward_backward(batches)
    expected = reference_objective(reference, batches, source.cfg.llm)
    expected.backward()
    assert abs(total.item() - expected.item()) / expected.item() < 1e-5
    assert 0 < engine.aux_metrics["moe_aux_loss"] < total.item()
    assert 0 < engine.aux_metrics["moe_load_min_layer0"] <= 0.25 <= engine.aux_metrics["moe_load_max_layer1"] < 1
    ours = dict(engine.model.named_parameters())
    for name, p in reference.named_parameters():
        if name.endswith(("router.weight", "experts.w1", "projector.0.weight")):
            assert ((ours[name].grad - p.grad).norm() / p.grad.norm()).item() < 1e-5, name


def test_activation_checkpointing_keeps_the_router_objective_and_gradients(lean_cfg):
    """Full activation checkpointing recomputes each block in backward; the routers' statistics taken in the first
    forward still carry their gradient (the recomputation replays the same routing)."""
    results = []
    for extra in ([], ["model.activations_checkpoint_granularity=full"]):
        cfg = lean_cfg(*MOE, *extra)
        source, batches = micro_batches(cfg, 1, 4)
        engine = make_engine(cfg, source)
        total, _ = engine.forward_backward(batches)
        grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if n.endswith("router.weight")}
        results.append((total.item(), grads, engine.aux_metrics["moe_aux_loss"]))
    (plain, plain_grads, plain_aux), (ac, ac_grads, ac_aux) = results
    assert all("_checkpoint_wrapped_module" in n for n in ac_grads)  # the blocks were checkpointed
    assert abs(ac - plain) / plain < 1e-6 and abs(ac_aux - plain_aux) / plain_aux < 1e-6
    plain_grads = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in plain_grads.items()}
    for name, g in ac_grads.items():
        ref = plain_grads[name.replace("_checkpoint_wrapped_module.", "")]
        assert ((g - ref).norm() / ref.norm()).item() < 1e-6, name
