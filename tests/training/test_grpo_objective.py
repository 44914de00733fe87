"""One GRPO update (loss, KL / clip metrics, gradients) on given rollouts equals each variant computed directly from
transformers' log-probabilities on a tiny LLaVA (fp32, CPU): with and without the KL term, a frozen reference model or
LoRA's adapters-off reference, recorded old log-probs (μ > 1) or none (μ = 1). The formulas below are TRL's
``GRPOTrainer`` (``_generate_and_score_completions``' advantages, ``_compute_loss``' per-token loss and its three
normalisations), written here independently of neva's code; the dual clip is EasyR1's ``compute_policy_loss``
(``clip_ratio_dual``) as Ye et al. 2020 define it."""

from __future__ import annotations

import pytest
import torch

from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.config import GRPOConfig
from neva.constants import IGNORE_INDEX
from neva.models.grpo_loss import group_advantages
from neva.models.lora import LoRALinear, adapters_disabled, apply_lora
from neva.models.media import Media, MediaInputs
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.grpo import GroupPolicyObjective, record_old_logps, token_forward
from tests.hf_oracle import neva_from_hf, tiny_llava

PROMPTS, G, MAX_NEW, BETA, EPS, EPS_HIGH = 2, 3, 6, 0.05, 0.2, 0.28
DUAL = 1.3  # the dual clip's c: low enough that the noise below puts some negative-advantage tokens' ratios above it
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 1.0])


def rollout_batch(hf) -> dict:
    """PROMPTS prompts (BOS, the image, text), G completions each of different lengths (≤ MAX_NEW), right-padded."""
    g = torch.Generator().manual_seed(0)
    vocab, image_id = hf.config.text_config.vocab_size, hf.config.image_token_index
    rows = []
    for p in range(PROMPTS):
        prompt = torch.randint(1, vocab - 1, (3 + p,), generator=g)
        for i in range(G):
            completion = torch.randint(1, vocab - 1, (2 + (i + p) % MAX_NEW,), generator=g)
            ids = torch.cat(
                [torch.tensor([1]), torch.full((hf.config.image_seq_length,), image_id), prompt, completion]
            )
            rows.append((ids, len(completion)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    mask = torch.zeros_like(input_ids)
    for r, (ids, n) in enumerate(rows):
        input_ids[r, : len(ids)], mask[r, : len(ids)] = ids, 1
        labels[r, len(ids) - n : len(ids)] = ids[-n:]
    pixels = torch.randn(PROMPTS, 3, 28, 28, generator=g).repeat_interleave(G, 0)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "pixel_values": pixels}


def neva_batch(b: dict) -> dict:
    rows, width = b["input_ids"].shape
    media = Media(image=MediaInputs(b["pixel_values"], None, items_per_row=torch.ones(rows, dtype=torch.long)))
    return {"input_ids": b["input_ids"], "labels": b["labels"], "position_ids": torch.arange(width).expand(1, rows, width),
            "media": media}  # fmt: skip


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob ``[B, S-1]`` of each next token, learned mask ``[B, S-1]``) from full ``[B, S, V]`` logits: position
    t's entry is token t+1's (the aligned layout neva's rollout tensors use)."""
    target = labels[:, 1:]
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return lp, (target != IGNORE_INDEX).float()


def hf_logps(hf, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hf(input_ids=b["input_ids"], pixel_values=b["pixel_values"], attention_mask=b["attention_mask"]).logits
    return token_logps(logits, b["labels"])


def trl_advantages(rewards: torch.Tensor, scale: str, group: int = G) -> torch.Tensor:
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    std = grouped.std(1).repeat_interleave(group) if scale == "group" else rewards.std().expand_as(rewards)
    return rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.3, 0.3, 2.0, -1.0, 0.0])
    ours, flat = group_advantages(rewards, 3, scale)
    torch.testing.assert_close(ours, trl_advantages(rewards, scale, 3))
    assert flat.tolist() == [False] * 3 + [True] * 3 + [False] * 3


def direct_loss(lp, old, ref, adv, mask, loss_type, beta, correction=False, dual=None):
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS_HIGH)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    capped = torch.zeros_like(per_token, dtype=torch.bool)
    if dual is not None:  # a negative advantage's clipped term, and its bound -c * A: the smaller (EasyR1's)
        bound = -adv[:, None] * dual
        capped = (adv[:, None] < 0) & (per_token > bound)
        per_token = torch.where(adv[:, None] < 0, torch.min(per_token, bound), per_token)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    if beta:
        per_token = per_token + beta * (kl * coef_1 if correction else kl)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum()
    else:
        loss = (per_token * mask).sum() / (per_token.size(0) * MAX_NEW)
    low = (coef_1 < 1 - EPS) & (adv[:, None] < 0)
    high = (coef_1 > 1 + EPS_HIGH) & (adv[:, None] > 0)
    clip = ((low | high | capped).float() * mask).sum() / mask.sum()
    return loss, (kl * mask).sum() / mask.sum(), clip


CASES = [
    ("grpo", 0.0, "none", True), ("grpo", BETA, "model", True), ("dapo", BETA, "model", True),
    ("dr_grpo", BETA, "model", False), ("dapo", 0.0, "none", False), ("grpo", BETA, "lora", True),
    ("dr_grpo", BETA, "lora", True), ("dapo", BETA, "model+correction", True), ("grpo", BETA, "model+dual", True),
]  # fmt: skip


@pytest.mark.parametrize("loss_type,beta,reference,recorded_old", CASES)
def test_update_equals_direct_computation(loss_type, beta, reference, recorded_old):
    torch.set_num_threads(1)
    correction = reference.endswith("+correction")  # the KL term weighted by the policy ratio
    dual = DUAL if reference.endswith("+dual") else None  # the dual clip
    reference = reference.removesuffix("+correction").removesuffix("+dual")
    hf, hf_ref = tiny_llava(seed=0), tiny_llava(seed=1)
    b = rollout_batch(hf)
    policy = neva_from_hf(hf)
    if reference == "lora":  # adapters that move the policy away from its base weights (B is zero at init)
        apply_lora(policy, ["wq", "wv", "w2"], rank=4, alpha=8.0, dropout=0.0)
        torch.manual_seed(2)
        for m in policy.modules():
            if isinstance(m, LoRALinear):
                torch.nn.init.normal_(m.lora_b.weight, std=0.05)
    cfg = GRPOConfig(num_generations=G, loss_type=loss_type, beta=beta, epsilon=EPS, epsilon_high=EPS_HIGH,
                     max_new_tokens=MAX_NEW, num_iterations=2 if recorded_old else 1,
                     kl_ratio_correction=correction, clip_ratio_dual=dual)  # fmt: skip
    objective = GroupPolicyObjective(cfg)
    cpu = torch.device("cpu")
    parallel = ParallelModel([policy], Layout(), None, policy)
    engine = Engine(parallel, Precision(), cpu, packed=False, head=objective, objectives=(objective,))
    batch = neva_batch(b)
    advantages = trl_advantages(REWARDS, "group")
    batch["advantages"] = group_advantages(REWARDS, G, "group")[0]
    if reference == "model":
        objective.reference = token_forward(engine, neva_from_hf(hf_ref).requires_grad_(False))
    elif reference == "lora":
        objective.reference = token_forward(engine, None, lambda: adapters_disabled(policy))
    with torch.no_grad():
        if reference == "model":
            ref, _ = hf_logps(hf_ref, b)
        elif reference == "lora":
            ref, _ = hf_logps(hf, b)  # adapters off = the HF weights
        else:
            ref = torch.zeros(1)
    # The policy's own log-probs, then (μ > 1) a later iteration's view of them: the sampler's, moved by noise so
    # that ratios leave the clip range on both sides.
    if recorded_old:
        batch = record_old_logps(engine, [batch])[0]
        noise = 0.4 * torch.randn(batch["old_token_logps"].shape, generator=torch.Generator().manual_seed(3))
        batch["old_token_logps"] = batch["old_token_logps"] + noise

    loss, count = engine.forward_backward([batch])
    metrics = engine.aux_metrics

    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    if reference == "lora":
        full = policy(b["input_ids"], neva_batch(b)["media"])
        lp, mask = token_logps(full, b["labels"])
        direct_params = params
    else:
        lp, mask = hf_logps(hf, b)
        prefixes = detect_prefixes(hf.state_dict().keys())
        direct_params = {hf_key_to_neva(n, prefixes): p for n, p in hf.named_parameters()}
        direct_params = {n: p for n, p in direct_params.items() if n in params}
    old = batch["old_token_logps"][:, :-1] if recorded_old else lp.detach()
    if recorded_old:  # the recorded values are the policy's own at the learned positions (noise aside)
        torch.testing.assert_close((old - noise[:, :-1]) * mask, lp.detach() * mask, rtol=1e-5, atol=1e-5)
    total, kl, clip = direct_loss(lp, old, ref, advantages, mask, loss_type, beta, correction, dual)
    if dual is not None:  # the cap binds on some learned tokens, and leaves others to the ratio
        ratio, negative = torch.exp(lp - old).detach(), advantages[:, None] < 0
        assert 0 < int(((ratio > dual) & negative & (mask > 0)).sum()) < int((negative & (mask > 0)).sum())
    kl, clip = kl.detach(), clip.detach()
    grads = torch.autograd.grad(total, list(direct_params.values()), allow_unused=True)

    expected_count = {"grpo": PROMPTS * G, "dapo": int(mask.sum()), "dr_grpo": PROMPTS * G * MAX_NEW}[loss_type]
    assert int(count) == expected_count
    torch.testing.assert_close(loss, total.detach(), rtol=1e-5, atol=1e-6)
    if beta:
        assert metrics["kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(float(clip), abs=1e-6)
    if recorded_old:
        assert 0 < metrics["clip_fraction"] < 1
    checked = 0
    for (name, _), grad in zip(direct_params.items(), grads):
        ours = params[name].grad
        if grad is None or not grad.abs().sum():
            assert ours is None or not ours.abs().sum(), name
            continue
        torch.testing.assert_close(ours, grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    assert checked > (10 if reference != "lora" else 2)


def test_reference_is_unused_without_kl():
    """beta 0 builds no reference: prepare adds only the rows' token counts."""
    objective = GroupPolicyObjective(GRPOConfig(beta=0.0))
    labels = torch.tensor([[IGNORE_INDEX, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 7]])
    out = objective.prepare({"labels": labels, "input_ids": labels.clamp(min=0)})
    assert out["row_tokens"].tolist() == [2, 1] and "ref_token_logps" not in out


def test_unscored_completions_leave_the_baseline():
    """A NaN reward (no function scored it): out of its group's mean and std, advantage 0 (TRL's rule)."""
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.5, 0.5, 0.5])
    ours, flat = group_advantages(rewards, 3, "group")
    expected = trl_advantages(torch.tensor([1.0, 0.0]), "group", 2)
    torch.testing.assert_close(ours, torch.tensor([expected[0], 0.0, expected[1], 0.0, 0.0, 0.0]))
    assert flat.tolist() == [False] * 3 + [True] * 3


def test_a_groups_image_is_encoded_once():
    """The rows of a group read its first row's image features (``group_media``): the tower encodes each prompt's
    image once, and the update's loss and gradients are those of encoding it in every row."""
    from neva.data.collate import collate_padded
    from neva.data.grpo_prompts import group_media

    torch.set_num_threads(1)
    hf = tiny_llava(seed=0)
    b = rollout_batch(hf)
    samples = []
    for r in range(PROMPTS * G):
        n = int(b["attention_mask"][r].sum())
        ids = b["input_ids"][r, :n]
        samples.append({"input_ids": ids, "labels": b["labels"][r, :n],
                        "image_positions": (ids == hf.config.image_token_index).nonzero().flatten(),
                        "pixel_values": b["pixel_values"][r : r + 1], "image_count": 1, "id": r})  # fmt: skip
    every = collate_padded(samples, 0, 8)
    firsts = collate_padded(samples[::G], 0, 8)
    grouped = {**every, "media": group_media(every["media"], firsts["media"], G)}
    assert grouped["media"].image.pixels.shape[0] == PROMPTS and grouped["media"].image.feature_rows is not None
    results = []
    for batch in (every, grouped):
        policy = neva_from_hf(hf)
        encoded = [0]

        def count(module, args, out, encoded=encoded):
            encoded[0] += args[0].shape[0]

        policy.vision.patch_embed.register_forward_hook(count)
        objective = GroupPolicyObjective(GRPOConfig(num_generations=G, max_new_tokens=MAX_NEW))
        engine = Engine(ParallelModel([policy], Layout(), None, policy), Precision(), torch.device("cpu"), packed=False,
                        head=objective, objectives=(objective,))  # fmt: skip
        batch = {**batch, "advantages": group_advantages(REWARDS, G, "group")[0]}
        loss, _ = engine.forward_backward([record_old_logps(engine, [batch])[0]])
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((loss, grads, encoded[0]))
    (loss_all, grads_all, n_all), (loss_once, grads_once, n_once) = results
    assert (n_all, n_once) == (2 * PROMPTS * G, 2 * PROMPTS)  # two forwards each: the old log-probs and the update
    torch.testing.assert_close(loss_once, loss_all, rtol=1e-6, atol=1e-7)
    for name, grad in grads_all.items():
        torch.testing.assert_close(grads_once[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_at_or_below_one_is_refused(c):
    """c ≤ 1 would cap a negative advantage's term below the clipped one's own value at ratio 1: refused."""
    with pytest.raises(ValueError, match=r"clip_ratio_dual must be > 1"):
        GRPOConfig(clip_ratio_dual=c)
