"""The planner's per-stage FLOPs are a view of the one FLOP count (``neva.models.flops``): stages add up to the whole
model, and per-GPU FLOPs add the TP split and activation-checkpoint recomputation counted by hand."""

import pytest

from neva.models.flops import SampleFlops
from neva.models.presets import build_config
from neva.models.trainable import LoraSpec, TrainablePolicy, build_meta_model
from neva.parallel.layout import Layout
from neva.planner.flops import stage_flops
from neva.planner.params import inventory, stage_layers

POLICIES = {
    "pretrain": TrainablePolicy(),
    "finetune": TrainablePolicy(llm=True),
    "lora": TrainablePolicy(lora=LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("wq", "wv", "w2"))),
}
SEQ = 48


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("pp,tp,ac", [(1, 1, None), (2, 2, "full"), (4, 1, "selective"), (3, 4, None)])
def test_stages_add_up_to_the_whole_model(policy, pp, tp, ac):
    cfg = build_config()  # the tiny preset: 4 decoder layers
    model = build_meta_model(cfg, POLICIES[policy])
    layout = Layout(tp=tp, pp=pp, ac=ac)
    stages = stage_flops(inventory(model), cfg, layout, SEQ, stage_layers(cfg.llm.num_layers, layout))
    assert len(stages) == pp
    assert sum(s.model for s in stages) == pytest.approx(SampleFlops.of(model).sample(SEQ, 1), rel=1e-12)
    assert all(s.backward for s in stages)  # the trained projector is upstream of every stage
    if tp == 1 and ac is None:
        assert [s.per_gpu for s in stages] == [s.model for s in stages]


def test_per_gpu_flops_split_over_tp_and_add_recomputation():
    """Pretraining on one stage, tp=2: the decoder and LM head halve, the replicated tower does not, the projector's
    two Linears halve (column then row parallel); full recomputation of the first ``n`` layers adds their forward."""
    cfg = build_config()
    model = build_meta_model(cfg, TrainablePolicy())
    infos = inventory(model)
    h, f, v, kv = 128, 352, 512, 64  # tiny preset: hidden, intermediate, vocab, kv heads × head dim
    layer_fwd = 2 * SEQ * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * SEQ * SEQ * h
    # Frozen decoder under the trained projector: weights forward + input gradient, attention core ×3.
    llm = cfg.llm.num_layers * (2 * 2 * SEQ * (2 * h * h + 2 * h * kv + 3 * h * f) + 3 * 4 * SEQ * SEQ * h)
    llm += 4 * SEQ * v * h
    vis = cfg.vision
    tokens = vis.num_patches + 1
    vision = 2 * vis.num_patches * 3 * 8 * 8 * 64  # patch convolution of the tiny tower (8 px patches, width 64)
    vision += 2 * tokens * (4 * 64 * 64 + 2 * 64 * 128) + 4 * tokens * tokens * 64  # 1 layer runs
    projector = cfg.num_image_tokens * (4 * 64 * h + 6 * h * h)
    for ac_layers in (None, 1, 3):
        layout = Layout(tp=2, ac="full" if ac_layers else None, ac_num_layers=ac_layers)
        (stage,) = stage_flops(infos, cfg, layout, SEQ, stage_layers(cfg.llm.num_layers, layout))
        assert stage.model == llm + vision + projector
        recompute = (ac_layers or 0) * layer_fwd / 2
        assert stage.per_gpu == pytest.approx(llm / 2 + vision + projector / 2 + recompute, rel=1e-12)


@pytest.mark.parametrize("vpp,first,num", [(1, None, None), (2, None, 1), (2, 2, 1), (1, 1, 2)])
def test_checkpointed_layers_are_the_blocks_training_wraps(vpp, first, num):
    """The planner's recomputed layers equal the blocks ``apply_compute_plans`` wraps in each real pipeline chunk."""
    import copy

    import torch

    from neva.config import ModelConfig
    from neva.parallel.compute_plans import apply_compute_plans
    from neva.parallel.pipeline import build_chunks
    from neva.planner.flops import checkpointed_layers

    cfg = build_config(num_layers=6)
    model = build_meta_model(cfg, POLICIES["finetune"])
    m = ModelConfig(activations_checkpoint_granularity="full", activations_checkpoint_num_layers=num)
    wrapped = set()
    for rank in range(2):
        for chunk in build_chunks(copy.deepcopy(model), rank, 2, vpp, first):
            apply_compute_plans(chunk, m, torch.device("cpu"))
            wrapped |= {int(k) for k, b in chunk.llm.layers.items() if hasattr(b, "_checkpoint_wrapped_module")}
    layout = Layout(pp=2, vpp=vpp, first_stage_layers=first, ac="full", ac_num_layers=num)
    assert checkpointed_layers(layout, 6) == wrapped
