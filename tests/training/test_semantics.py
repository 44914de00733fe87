"""Freeze policy, bf16 O2 dtypes and gradient-accumulation equivalence (single process, CPU)."""

import pytest
import torch

from neva.models.lora import LoRALinear
from neva.models.rope import rope_cos_sin
from neva.models.trainable import build_meta_model
from neva.parallel.layout import Layout
from neva.parallel.parallelize import parallelize
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.optim import build_optimizer
from tests.training.conftest import micro_batches


def make_engine(cfg, source, precision: Precision | None = None):
    """The one-process engine, built as ``NevaModule.configure_model`` builds it for every layout."""
    precision = precision or Precision()
    cpu = torch.device("cpu")
    model = build_meta_model(source.cfg, cfg.model.trainable_policy())
    parallel = parallelize(model, source, Layout.from_config(cfg.model, world=1), cfg.model, cpu, precision)
    return Engine(
        parallel, precision, cpu, packed=cfg.model.data.packing, loss_normalization=cfg.model.loss_normalization
    )


def trainable_parts(model):
    return sorted({n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad})


def test_pretrain_trains_only_the_projector_and_grads_cross_the_frozen_llm(lean_cfg):
    cfg = lean_cfg()
    source, batches = micro_batches(cfg, 1, 4)
    engine = make_engine(cfg, source)
    model = engine.model
    assert trainable_parts(model) == ["projector"]
    vision_out = []
    model.vision.register_forward_hook(lambda m, i, o: vision_out.append(o))
    captured = []
    model.vision.features = (lambda f: lambda px: captured.append(f(px)) or captured[-1])(model.vision.features)
    engine.forward_backward(batches)
    assert all(p.grad is None for p in model.llm.parameters())
    assert all(p.grad is None for p in model.vision.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.projector.parameters())
    assert captured and not captured[0].requires_grad  # the frozen tower ran without autograd


@pytest.mark.parametrize("lora", [False, True])
def test_finetune_freeze_policy(lean_cfg, lora):
    overrides = ["model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"]
    if lora:
        overrides.append("model.peft.peft_scheme=lora")
    cfg = lean_cfg(*overrides)
    source, batches = micro_batches(cfg, 1, 4)
    engine = make_engine(cfg, source)
    model = engine.model
    assert trainable_parts(model) == ["llm", "projector"]
    if lora:
        wrapped = [m for m in model.modules() if isinstance(m, LoRALinear)]
        assert wrapped and all(not m.base.weight.requires_grad for m in wrapped)
        trainable_llm = [n for n, p in model.llm.named_parameters() if p.requires_grad]
        assert trainable_llm and all(".lora_" in n for n in trainable_llm)
    engine.forward_backward(batches)
    assert all(p.grad is None for p in model.vision.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_bf16_o2_keeps_fp32_master_weights_and_optimizer_state(lean_cfg):
    cfg = lean_cfg("trainer.precision=bf16-mixed", "model.megatron_amp_O2=true")
    precision = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
    assert precision.master_weights and precision.param_dtype == torch.bfloat16
    source, batches = micro_batches(cfg, 2, 2)
    engine = make_engine(cfg, source, precision)
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    opt = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    engine.forward_backward(batches)
    masters = [p for _, p in engine.named_trainable_parameters()]
    assert masters and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in masters)
    assert all(p.grad is None for p in engine.master.model_params)  # moved into the fp32 accumulators
    opt.step()
    engine.after_optimizer_step()
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]
    assert states and all(t.dtype == torch.float32 for t in states)
    for model_p, master_p in zip(engine.master.model_params, masters):
        assert torch.equal(model_p, master_p.to(torch.bfloat16))


def test_o2_keeps_rope_buffers_fp32(lean_cfg):
    """O2 casts parameters, never RoPE's ``inv_freq``: positions far out keep their fp32 angle."""
    source, _ = micro_batches(lean_cfg(), 1, 1)
    fp32 = make_engine(lean_cfg(), source).model
    o2_cfg = lean_cfg("trainer.precision=bf16-mixed", "model.megatron_amp_O2=true")
    o2 = make_engine(o2_cfg, source, Precision.from_config("bf16-mixed", True)).model
    assert all(p.dtype == torch.bfloat16 for p in o2.parameters())
    assert o2.llm.inv_freq.dtype == torch.float32
    positions = torch.tensor([[0, 2047, 4095]])
    want = rope_cos_sin(fp32.llm.inv_freq, positions, torch.bfloat16)
    got = rope_cos_sin(o2.llm.inv_freq, positions, torch.bfloat16)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # What the bug did: a bf16 inv_freq puts the angle at 4095 radians off by far more than bf16 rounding.
    bad = rope_cos_sin(fp32.llm.inv_freq.bfloat16(), positions, torch.float32)[0]
    assert (bad - rope_cos_sin(fp32.llm.inv_freq, positions, torch.float32)[0]).abs().max() > 0.1


def test_accumulation_equals_larger_micro_batch(lean_cfg):
    cfg = lean_cfg(
        "model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"
    )
    source, small = micro_batches(cfg, 2, 2)
    _, big = micro_batches(cfg, 1, 4)
    assert sum(b.counts.num_samples for b in small) == big[0].counts.num_samples == 4

    results = []
    for batches in (small, big):
        engine = make_engine(cfg, source)
        opt = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
        loss, tokens = engine.forward_backward(batches)
        opt.step()
        params = torch.cat([p.detach().flatten() for _, p in engine.named_trainable_parameters()])
        results.append((loss.item(), tokens.item(), params))
    (loss_a, tok_a, p_a), (loss_b, tok_b, p_b) = results
    assert tok_a == tok_b
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert torch.allclose(p_a, p_b, rtol=0, atol=1e-6)


def test_head_on_learned_positions_only_gives_the_full_logits_loss(lean_cfg):
    cfg = lean_cfg(
        "model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"
    )
    source, batches = micro_batches(cfg, 1, 4)
    engine = make_engine(cfg, source)
    sparse = engine.loss_sum(batches[0])
    engine.learned_only_head = False
    full = engine.loss_sum(batches[0])
    assert sparse.item() == pytest.approx(full.item(), rel=1e-6)


def test_learned_positions_path_keeps_lora_dropout_masks_and_gradients(lean_cfg):
    """The last decoder layer runs its output projection and MLP at learned positions only (``rows``): with keyed
    LoRA dropout the adapters there see those positions' masks, so loss and gradients equal the full-logits path."""
    cfg = lean_cfg(
        "model.restore_from_path=null",
        "model.mm_cfg.llm.freeze=false",
        "model.data.conv_template=vicuna_v1",
        "model.peft.peft_scheme=lora",
        "model.peft.lora_tuning.adapter_dropout=0.3",
    )
    source, batches = micro_batches(cfg, 1, 4)
    results = []
    for learned_only in (True, False):
        engine = make_engine(cfg, source)
        engine.learned_only_head = learned_only
        loss, _ = engine.forward_backward(batches)
        results.append((loss.item(), {n: p.grad for n, p in engine.named_trainable_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_checkpointing_changes_memory_not_numbers(lean_cfg, granularity, lora):
    """Also with LoRA dropout: the recomputation in backward draws the forward's masks."""
    base = ["model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"]
    if lora:
        base += ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dropout=0.3"]
    results = []
    for extra in ([], [f"model.activations_checkpoint_granularity={granularity}"]):
        cfg = lean_cfg(*base, *extra)
        source, batches = micro_batches(cfg, 1, 4)
        engine = make_engine(cfg, source)
        loss, _ = engine.forward_backward(batches)
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in engine.named_trainable_parameters()}
        results.append((loss.item(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert any("_checkpoint_wrapped_module" in n for n, _ in engine.model.named_parameters())
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], rtol=1e-5, atol=1e-7), name


def test_pretrain_step_on_text_only_batches_reaches_the_projector(lean_cfg):
    """Only the projector trains in pretraining; a text-only batch still has a gradient path to it (zero gradients,
    as LLaVA's empty image slice gives) instead of a backward without anything to differentiate."""
    cfg = lean_cfg()
    source, batches = micro_batches(cfg, 1, 4)
    batch = batches[0]
    image = source.cfg.image_token_id
    batch = batch.with_(input_ids=batch.input_ids.masked_fill(batch.input_ids == image, 7), media=None)
    engine = make_engine(cfg, source)
    loss, tokens = engine.forward_backward([batch])
    assert tokens > 0 and torch.isfinite(loss)
    grads = [p.grad for p in engine.model.projector.parameters()]
    assert grads and all(g is not None and not g.any() for g in grads)
