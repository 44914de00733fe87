"""The GRPO update on shared-prompt rows (``neva.data.grpo_rows``: each prompt once in its group's row) equals the
update on separate rows (one row per completion, the prompt repeated): loss, gradients and the objective's metrics,
with a KL term to a reference, recorded old log-probs moved so that ratios clip (μ > 1) and a completion dropped by
dynamic sampling; the step divisor of every loss type. On the tiny LLaVA (dense, one position axis), on Qwen2.5-VL's
native resolution (M-RoPE: the completions' positions continue the prompt's on three axes) and on Gemma 3 (sliding
window layers of 16 tokens, shorter than a prompt; bidirectional attention inside the prompt's image). The separate rows are
themselves checked against a direct computation from transformers' log-probs (test_grpo_objective) and the shared
ones against a direct computation per completion (test_grpo_families)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from neva.config import GRPOConfig
from neva.constants import IGNORE_INDEX
from neva.data.grpo_prompts import collate_groups, completion_sample
from neva.data.grpo_rows import collate_shared_prompts
from neva.models.grpo_loss import group_advantages
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.grpo import GroupPolicyObjective, record_old_logps, shares_prompts, token_forward
from tests.training.test_grpo_families import G, stage_module


@pytest.mark.parametrize("family", ["llama_clip", "qwen2_5_vl_native", "gemma3"])
def test_shared_prompt_rows_equal_separate_rows(tmp_path, family):
    torch.set_num_threads(1)
    module, batch = stage_module(tmp_path, family)
    step, prompts = module.stage_step, batch["prompts"]
    policy = module.engine.parts[0]
    completions = step.rollouts.sample(prompts, G, list(range(len(prompts) * G)))
    ids = [torch.tensor(c) for c in completions]
    assert len({len(c) for c in ids}) > 1 or len({len(p["input_ids"]) for p in prompts}) > 1  # padding differs
    keep = [True, True, False, True]  # the third completion dropped (dynamic sampling): nothing learned
    learned = [c if k else torch.full_like(c, IGNORE_INDEX) for c, k in zip(ids, keep)]
    separate = collate_groups([completion_sample(prompts[i // G], c, lab) for i, (c, lab) in enumerate(zip(ids, learned))],
                              G, step.pad_id, 8)  # fmt: skip
    shared = collate_shared_prompts(prompts, ids, learned, G, step.pad_id, 8)
    assert shared["input_ids"].shape[0] == len(prompts) and separate["input_ids"].shape[0] == len(ids)
    assert shared["segment_ids"].gt(0).sum() < separate["segment_ids"].gt(0).sum()  # fewer positions to run
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.3, 0.9]), G, "group")[0]
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # a reference apart from the policy: KL > 0
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cfg = GRPOConfig(num_generations=G, loss_type="grpo", beta=0.05, epsilon_high=0.28, num_iterations=2,
                     max_new_tokens=5)  # fmt: skip

    results = []
    for rows in (separate, shared):
        objective = GroupPolicyObjective(cfg)
        engine = Engine(ParallelModel([policy], Layout(), None, policy), Precision(), torch.device("cpu"),
                        packed=False, head=objective, objectives=(objective,))  # fmt: skip
        objective.reference = token_forward(engine, reference)
        policy.zero_grad(set_to_none=True)
        rows = record_old_logps(engine, [{**rows, "advantages": advantages}])[0]
        # the sampler's log-probs a later iteration sees: moved by noise drawn per completion token, alike for both
        old, at = rows["old_token_logps"], completion_positions(rows)
        noise = 0.4 * torch.randn(len(at), generator=torch.Generator().manual_seed(3))
        rows["old_token_logps"] = old.index_put((at[:, 0], at[:, 1]), old[at[:, 0], at[:, 1]] + noise)
        counts = {t: int(GroupPolicyObjective(GRPOConfig(loss_type=t, max_new_tokens=5)).count(rows))
                  for t in ("grpo", "dapo", "dr_grpo")}  # fmt: skip
        loss, _ = engine.forward_backward([rows])
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((loss, grads, {k: float(v) for k, v in engine.aux_metrics.items()}, counts))
    (loss_a, grads_a, metrics_a, counts_a), (loss_b, grads_b, metrics_b, counts_b) = results
    assert counts_a == counts_b == {"grpo": 3, "dapo": sum(len(c) for c, k in zip(ids, keep) if k), "dr_grpo": 15}
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-7)
    assert metrics_a["kl"] > 0 and 0 < metrics_a["clip_fraction"] < 1
    for key, value in metrics_a.items():
        assert metrics_b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert grads_a.keys() == grads_b.keys() and {n.split(".")[0] for n in grads_a} >= {"llm", "projector"}
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def completion_positions(rows: dict) -> torch.Tensor:
    """``[T, 2]`` (row, column) of every completion token's prediction, completion by completion, each in order: the
    same tokens in the same order for both row forms (aligned as ``old_token_logps``: column t predicts t + 1)."""
    if "completion_at" in rows:
        at = rows["completion_at"]
        found = [(at == k).nonzero() for k in range(int(at.max()) + 1)]
    else:
        found = [(rows["labels"][r : r + 1, 1:] != IGNORE_INDEX).nonzero() + torch.tensor([r, 0])
                 for r in range(rows["labels"].shape[0])]  # fmt: skip
    return torch.cat(found)


def test_shared_prompt_rows_are_one_decision():
    """``shares_prompts``: one process (and data parallelism) shares; each layout, LoRA keyed dropout and decoder
    that cannot take a shared prefix (or whose MoE balancing would count the prompt once) falls back to separate
    rows."""

    def engine(llm=None, dropout=False, sp=1, join=False, **layout):
        llm = SimpleNamespace(
            **{"linear_attention": None, "attention_chunk_size": None, "is_moe": False, **(llm or {})}
        )
        return SimpleNamespace(parallel=SimpleNamespace(layout=Layout(**layout)), parts=[SimpleNamespace(
            cfg=SimpleNamespace(llm=llm))], sp_multiple=sp, join_rows=join, keyed_dropout=dropout)  # fmt: skip

    assert shares_prompts(engine()) and shares_prompts(engine(dp=2))
    for refused in (engine(tp=2), engine(pp=2), engine(cp=2), engine(sp=2), engine(join=True), engine(dropout=True),
                    engine({"linear_attention": object()}), engine({"attention_chunk_size": 8}), engine({"is_moe": True})):  # fmt: skip
        assert not shares_prompts(refused)


def test_a_prompt_ending_on_an_image_is_not_shared():
    """A prompt whose last token is a media position (its features would have to repeat in every completion's
    segment), or of one token, leaves the micro-batch to separate rows (None); otherwise the row is the prompt but its
    last token, then per completion that token and the completion, at the separate row's positions."""
    image = {"pixel_values": torch.zeros(1, 3, 4, 4), "image_count": 1, "id": 0}
    ends = {**image, "input_ids": torch.tensor([1, 5, 9]), "labels": torch.full((3,), IGNORE_INDEX),
            "image_positions": torch.tensor([2])}  # fmt: skip
    fine = {**ends, "image_positions": torch.tensor([1])}
    one = {**image, "input_ids": torch.tensor([1]), "labels": torch.full((1,), IGNORE_INDEX), "pixel_values":
           torch.zeros(0, 3, 4, 4), "image_count": 0}  # fmt: skip
    c = [torch.tensor([7, 8]), torch.tensor([6])]
    assert collate_shared_prompts([ends], c, c, 2, 0, 8) is None
    assert collate_shared_prompts([one], c, c, 2, 0, 8) is None
    rows = collate_shared_prompts([fine], c, c, 2, 0, 8)
    assert rows["input_ids"][0, :7].tolist() == [1, 5, 9, 7, 8, 9, 6]
    assert rows["position_ids"][0, 0, :7].tolist() == [0, 1, 2, 3, 4, 2, 3]
    assert rows["segment_ids"][0].tolist() == [1, 1, 2, 2, 2, 3, 3, 0]
    assert rows["labels"][0, :7].tolist() == [IGNORE_INDEX] * 3 + [7, 8, IGNORE_INDEX, 6]
    assert rows["completion_at"][0].tolist() == [-1, -1, 0, 0, -1, 1, -1, -1] and rows["row_tokens"].tolist() == [2, 1]
