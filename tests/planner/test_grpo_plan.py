"""The planner's online RL stage: a prompt is its group's rows (activations, FLOPs), the frozen reference counted
only with a KL term, and the rollout's KV cache (rows × (positions + max new tokens) × layers × keys and values of a
rank's kv heads) against the update's activations, the larger of the two in the peak."""

from __future__ import annotations

from neva.config import compose_config
from neva.models.presets import build_config
from neva.planner.plan import plan_run

BASE = ["+stage=grpo", "cluster=dgx_h100", "model.global_batch_size=16", "model.grpo.num_generations=4",
        "model.grpo.max_new_tokens=1024", "model.restore_from_path=null"]  # fmt: skip


def test_rollout_cache_reference_and_group_rows():
    with_kl = plan_run(compose_config([*BASE, "model.grpo.beta=0.04"]), text_tokens=100)
    without = plan_run(compose_config([*BASE, "model.grpo.beta=0.0"]), text_tokens=100)
    finetune = plan_run(compose_config(["+stage=finetune", "cluster=dgx_h100", "model.global_batch_size=16",
                                       "model.micro_batch_size=2", "model.data.pad_to_multiple_of=8"]),  # the stage's
                        text_tokens=100)  # fmt: skip
    llm = build_config().llm  # the tiny default's decoder
    stage = with_kl.stages[0]
    rows = 2 * 4  # micro-batch of 2 prompts x 4 completions
    assert stage.rollout == rows * (with_kl.seq_len + 1024) * llm.num_layers * 2 * llm.num_kv_heads * llm.head_dim * 4
    assert stage.reference > 0 and without.stages[0].reference == 0
    assert with_kl.flops_per_sample > without.flops_per_sample  # the reference's forward
    assert without.flops_per_sample == 4 * finetune.flops_per_sample  # a prompt's four rows, same sequence
    assert stage.total >= stage.params + stage.grads + stage.optimizer + stage.reference + stage.rollout
