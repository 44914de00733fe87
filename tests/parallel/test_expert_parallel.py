"""Expert parallelism on LLaVA-format data against one process, step by step (gloo, CPU): the loss with the routers'
objective, the gradient norm, and the gradients of a router and of an expert tensor; on a batch whose routing is
uneven (one expert receives no token, one receives most), so the all-to-all runs with empty and lopsided splits."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from .harness import BASE, run_layouts
from .llava_data import llava_overrides, write_llava_set

pytestmark = pytest.mark.slow

STEPS = 2  # per layout; the checkpoint chain continues to RESUMED_STEPS
RESUMED_STEPS = 5
RTOL = 1e-5
# bf16 O2 against the fp32 reference: bf16 keeps 8 significant bits (relative spacing 2^-8 ~ 0.4 %); a step's loss,
# norms and gradients accumulate several such roundings
BF16_RTOL = 3e-2
O2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"]
EP2 = "model.expert_model_parallel_size=2"
CP2 = "model.context_parallel_size=2"
MOE = "++model.mm_cfg.llm.arch_overrides={num_layers:2,num_moe_experts:4,moe_aux_loss_coeff:0.1,moe_z_loss_coeff:0.01}"
WATCHED = ("llm.layers.1.feed_forward.router.weight", "llm.layers.1.feed_forward.experts.w1")


def make_uneven_checkpoint(directory: Path) -> Path:
    """A tiny MoE checkpoint whose routers send every token to expert 1 first and never to expert 0: every hidden
    state carries a large common direction u (added to the token embeddings and the projector's output bias), and
    each router's rows for experts 1 and 0 are +u and -u."""
    from neva.checkpoint.neva_format import save_checkpoint
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.models.neva import NevaModel

    cfg = compose_config([o.replace("+stage=finetune", "+stage=pretrain") for o in BASE] + [MOE])
    source = resolve_source(cfg)
    torch.manual_seed(0)
    model = NevaModel(source.cfg)
    model.init_weights()
    d = source.cfg.llm.hidden_size
    u = torch.nn.functional.normalize(torch.randn(d, generator=torch.Generator().manual_seed(7)), dim=0)
    with torch.no_grad():
        model.llm.tok_embeddings.weight.add_(0.5 * u)
        model.projector[-1].bias.add_(0.5 * u)
        for layer in model.llm.layers.values():
            router = layer.feed_forward.router.weight
            router[1] = 2.0 * u
            router[0] = -2.0 * u
    return save_checkpoint(directory, source.cfg, model.state_dict(), source.tokenizer, overwrite=True)


def _full(t: torch.Tensor) -> list:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().flatten().tolist()


def train(overrides: list[str], steps: int, start: int = 0, load: str | None = None, save: str | None = None) -> dict:
    """``NevaModule``'s training step without Lightning, steps ``start`` to ``steps - 1``; per step the loss, MoE
    metrics and gradient norm, and the first step's gradients of ``WATCHED``. ``load`` / ``save``: a DCP checkpoint
    (parameters and AdamW state) read before the first step / written after the last."""
    from neva.checkpoint import dcp
    from neva.checkpoint.names import canonical_name
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.data.datamodule import NevaDataModule
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer, build_scheduler

    cfg = compose_config(BASE + [MOE] + overrides)
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = NevaDataModule(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    data.setup("fit")
    module = NevaModule(cfg, source, data, layout)
    module.configure_model()
    engine = module.engine
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim, cfg.trainer.max_steps)
    if load is not None:
        dcp.load(load, engine.checkpoint_parameters(), optimizer)
        engine.after_optimizer_step()
    with warnings.catch_warnings():  # the schedule advanced to the resumed step before any optimizer step
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start):
            scheduler.step()
    out = {"losses": [], "grad_norms": [], "metrics": [], "grads": {}}
    for i, micro_batches in enumerate(StepBatches(data, layout.grad_accum)):
        if i == steps:
            break
        if i < start:
            continue
        engine.model.train()
        loss, _ = engine.forward_backward(micro_batches, step=i)
        if i == start:
            for name, p in engine.named_trainable_parameters():
                if canonical_name(name) in WATCHED:
                    out["grads"][canonical_name(name)] = _full(p.grad)
        out["grad_norms"].append(engine.clip_grad_norm(cfg.trainer.gradient_clip_val).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.after_optimizer_step()
        scheduler.step()
        out["losses"].append(loss.item())
        out["metrics"].append(dict(engine.aux_metrics))
    if save is not None:
        dcp.save(save, engine.checkpoint_parameters(), optimizer)
    return out


def run(world: int, jobs: list, out: Path) -> list[dict]:
    return run_layouts(world, jobs, out, train=train)


def _rel(a: list[float], b: list[float]) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    ckpt = make_uneven_checkpoint(root / "ckpt")
    write_llava_set(root / "llava")
    # Global batches of 4 single-sample micro-batches (one per rank under 4-rank layouts): the least work per step.
    data = [f"model.restore_from_path={ckpt}", *llava_overrides(root / "llava", False)]
    data += ["model.micro_batch_size=1", "model.global_batch_size=4"]
    ref = train(data, RESUMED_STEPS)
    first = ref["metrics"][0]
    for layer in (0, 1):  # the uneven batch: expert 0 idle, expert 1 at the top of every token's choice
        assert first[f"moe_load_min_layer{layer}"] == 0.0 and first[f"moe_load_max_layer{layer}"] >= 0.5
    return data, ref


def check(got: dict, ref: dict, name: str, start: int = 0, rtol: float = RTOL) -> None:
    """``got`` (steps ``start``...) equals the one-process ``ref`` on the same steps (within ``rtol``)."""
    n = len(got["losses"])
    assert _max_rel(got["losses"], ref["losses"][start : start + n]) < rtol, (name, got["losses"], ref["losses"])
    assert _max_rel(got["grad_norms"], ref["grad_norms"][start : start + n]) < rtol, (name, got["grad_norms"])
    aux = [m["moe_aux_loss"] for m in got["metrics"]]
    assert _max_rel(aux, [m["moe_aux_loss"] for m in ref["metrics"][start : start + n]]) < rtol, (name, aux)
    if start == 0:
        loads = {k: v for k, v in ref["metrics"][0].items() if k.startswith("moe_load")}  # the uneven routing
        assert {k: got["metrics"][0][k] for k in loads} == pytest.approx(loads, rel=rtol), name
        for key in WATCHED:
            assert _rel(got["grads"][key], ref["grads"][key]) < rtol, (name, key)


def test_expert_parallel_two_ranks_and_resume_across_ep_sizes(setup, tmp_path):
    """EP2 (its two steps against one process) writes a DCP checkpoint; EP1×DP2 resumes it for a step and writes
    another; CP2×EP2 (the expert group drawn from the cp pair) resumes that for a step and writes a third; one process
    resumes that: every step on the uninterrupted one-process curve. In the same spawn: EP2
    under DDP (experts' gradients reduced over their replicas by hand), under bf16 O2 (FSDP2's fp32 masters and
    gradients, the experts cast by FSDP2 as the rest) and with every block recomputed in backward (the routers and
    the all-to-all dispatch run again: the objective and the logged loads must count once), one step each."""
    data, ref = setup
    ep2, dp2, cp2 = str(tmp_path / "ep2.dcp"), str(tmp_path / "dp2.dcp"), str(tmp_path / "cp2_ep2.dcp")
    jobs = [
        ("ep2", data + [EP2], dict(steps=STEPS, save=ep2)),
        ("ep1_dp2", data, dict(steps=STEPS + 1, start=STEPS, load=ep2, save=dp2)),
        ("cp2_ep2", data + [CP2, EP2], dict(steps=STEPS + 2, start=STEPS + 1, load=dp2, save=cp2)),
        ("ep2_ddp", data + [EP2, "model.data_parallel=ddp"], dict(steps=1)),
        ("ep2_o2", data + [EP2, *O2], dict(steps=1)),
        ("ep2_recompute", data + [EP2, "model.activations_checkpoint_granularity=full"], dict(steps=1)),
    ]
    results = run(2, jobs, tmp_path / "out")
    for rank in results:
        check(rank["ep2"], ref, "ep2")
        check(rank["ep1_dp2"], ref, "ep1_dp2", start=STEPS)
        check(rank["cp2_ep2"], ref, "cp2_ep2", start=STEPS + 1)
        check(rank["ep2_ddp"], ref, "ep2_ddp")
        check(rank["ep2_o2"], ref, "ep2_o2", rtol=BF16_RTOL)
        check(rank["ep2_recompute"], ref, "ep2_recompute")
    one = train(data, RESUMED_STEPS, start=STEPS + 2, load=cp2)
    check(one, ref, "one process", start=STEPS + 2)


FOUR_RANK = {
    "ep2_dp2": [EP2],
    "ep2_tp2_sp": [EP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2_ep2": [EP2, "model.pipeline_model_parallel_size=2"],
}


def test_expert_parallel_four_rank_layouts_match_one_process(setup, tmp_path):
    """4 ranks, one spawn: EP2×DP2 (two expert groups, each expert sharded over its two replicas by FSDP2 over
    edp); EP2×TP2+SP (router and experts replicated over tp, experts split over ep, attention tp-sharded); PP2×EP2
    (each stage's routers add their objective in the stage's backward)."""
    data, ref = setup
    results = run(4, [(n, data + o, dict(steps=STEPS)) for n, o in FOUR_RANK.items()], tmp_path)
    for name in FOUR_RANK:
        # a pipeline stage holds some layers' gradients: the watched ones come from whichever ranks hold them
        grads = {k: v for rank in results for k, v in rank[name]["grads"].items()}
        for rank in results:
            check({**rank[name], "grads": grads}, ref, name)
