"""One-process O2 bookkeeping (flat fp32 main-grad buffer, hooks, foreach clip and publish) against the per-parameter
algorithm it replaced, kept here as the oracle: fp32 masters stepped by hand beside bf16 parameters."""

import torch

from neva.parallel.precision import Precision, cast_parameters
from neva.training.optim import build_optimizer
from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine

STEPS = 3
CLIP = 0.05  # far below the tiny model's gradient norm: clipping acts on every step


def _oracle_step(engine, model_params, masters, batches):
    """The previous bookkeeping: per-parameter ``p.grad.float()`` into the masters after each micro-batch, a norm
    per parameter; returns (loss, gradients, norm)."""
    weight = 1 / engine.global_tokens(batches).clamp(min=1.0)  # model.loss_normalization=global_tokens
    total = torch.zeros(())
    for mb in batches:
        loss = engine.loss_sum(mb)
        (loss * weight).backward()
        total += loss.detach() * weight
        for p, m in zip(model_params, masters):
            if p.grad is None:
                continue
            m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad.float())
            p.grad = None
    grads_before = [m.grad.clone() for m in masters if m.grad is not None]
    sq = torch.zeros(())
    for m in masters:
        if m.grad is not None:
            sq += torch.linalg.vector_norm(m.grad.float()) ** 2
    return total, grads_before, sq.sqrt()


def _oracle_clip(masters, clip, norm):
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    for m in masters:
        if m.grad is not None:
            m.grad.mul_(coef)


def test_o2_main_grad_buffer_matches_per_parameter_master_math(lean_cfg):
    cfg = lean_cfg(
        "model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1",
        "trainer.precision=bf16-mixed", "model.megatron_amp_O2=true",
    )  # fmt: skip
    source, batches = micro_batches(cfg, 2, 2)
    o2 = make_engine(cfg, source, Precision.from_config("bf16-mixed", True))
    # The oracle: the same bf16 model without master weights (fp32 engine, parameters cast by hand), masters kept here.
    oracle = make_engine(cfg, source)
    named = [(n, p) for n, p in oracle.named_trainable_parameters()]
    masters = [torch.nn.Parameter(p.detach().float().clone()) for _, p in named]
    model_params = [p for _, p in named]
    cast_parameters(oracle.model, torch.bfloat16)
    opt_new = build_optimizer(o2.named_trainable_parameters(), cfg.model.optim)
    opt_old = build_optimizer([(n, m) for (n, _), m in zip(named, masters)], cfg.model.optim)

    # Every bf16 gradient is freed by its hook before the next one is produced.
    live = []
    for p in o2.master.model_params:
        p.register_post_accumulate_grad_hook(
            lambda _: live.append(sum(q.grad is not None for q in o2.master.model_params))
        )
    for step in range(STEPS):
        loss, _ = o2.forward_backward(batches)
        grads = [m.grad.clone() for _, m in o2.named_trainable_parameters() if m.grad is not None]
        norm = o2.clip_grad_norm(CLIP)
        opt_new.step()
        opt_new.zero_grad(set_to_none=True)
        o2.after_optimizer_step()

        want_loss, want_grads, want_norm = _oracle_step(oracle, model_params, masters, batches)
        # The two norms differ by fp32 summation order; clipping both runs with the same one keeps every later step
        # bit-comparable (bf16 parameters would otherwise amplify a last-bit difference of the coefficient).
        torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
        _oracle_clip(masters, CLIP, norm)
        opt_old.step()
        opt_old.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model_params, masters):
                p.copy_(m)

        assert loss.item() == want_loss.item(), step
        assert len(grads) == len(want_grads) and all(torch.equal(a, b) for a, b in zip(grads, want_grads)), step
        assert norm.item() > CLIP
    assert live and max(live) == 0
    assert all(p.grad is None for p in o2.master.model_params)
    new_masters = [m for _, m in o2.named_trainable_parameters()]
    assert all(torch.equal(got, want) for got, want in zip(new_masters, masters))
    for p, m in zip(o2.master.model_params, new_masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # published with one foreach copy
