"""One preference step (loss, rewards, gradients) equals each objective computed directly from transformers'
log-probabilities on a tiny LLaVA (fp32, CPU): a frozen reference model, LoRA's adapters-off reference and
precomputed reference log-probs. The formulas below are TRL's ``DPOTrainer.dpo_loss``, written here independently of
neva's table."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.config import DPOConfig
from neva.constants import IGNORE_INDEX
from neva.data.micro_batch import MicroBatch, PreferencePairs
from neva.models.lora import LoRALinear, adapters_disabled, apply_lora
from neva.models.media import Media, MediaInputs
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.precision import Precision
from neva.training.dpo import PreferenceObjective, reference_forward
from neva.training.engine import Engine
from tests.hf_oracle import neva_from_hf, tiny_llava

BETA, SMOOTHING, PAIRS = 0.3, 0.1, 2


def direct_losses(loss_type: str, h: torch.Tensor) -> torch.Tensor:
    b, e = BETA, SMOOTHING
    if loss_type == "sigmoid":
        return -F.logsigmoid(b * h) * (1 - e) - F.logsigmoid(-b * h) * e
    if loss_type == "robust":
        return (-F.logsigmoid(b * h) * (1 - e) + F.logsigmoid(-b * h) * e) / (1 - 2 * e)
    if loss_type == "hinge":
        return torch.relu(1 - b * h)
    return (h - 1 / (2 * b)) ** 2  # ipo


def pair_batch(hf) -> dict:
    """PAIRS pairs, each a prompt (BOS, the image, text) with two replies of different lengths, chosen rows first."""
    g = torch.Generator().manual_seed(0)
    vocab, image_id = hf.config.text_config.vocab_size, hf.config.image_token_index
    prompts = [torch.randint(1, vocab - 1, (3 + i,), generator=g) for i in range(PAIRS)]
    rows = []
    for side in (0, 1):
        for i in range(PAIRS):
            reply = torch.randint(1, vocab - 1, (2 + 2 * side + i,), generator=g)
            rows.append((torch.cat([torch.tensor([1]), torch.full((hf.config.image_seq_length,), image_id),
                                    prompts[i], reply]), len(reply)))  # fmt: skip
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(2 * PAIRS, width, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    mask = torch.zeros_like(input_ids)
    for r, (ids, n) in enumerate(rows):
        input_ids[r, : len(ids)], mask[r, : len(ids)] = ids, 1
        labels[r, len(ids) - n : len(ids)] = ids[-n:]
    pixels = torch.randn(PAIRS, 3, 28, 28, generator=g).repeat(2, 1, 1, 1)  # both replies of a pair see its image
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "pixel_values": pixels}


def neva_batch(b: dict) -> MicroBatch:
    rows, width = b["input_ids"].shape
    media = Media(image=MediaInputs(b["pixel_values"], None, items_per_row=torch.ones(rows, dtype=torch.long)))
    positions = torch.arange(width).expand(1, rows, width)
    return MicroBatch(input_ids=b["input_ids"], labels=b["labels"], position_ids=positions, media=media,
                      stage=PreferencePairs(pairs=PAIRS))  # fmt: skip


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's labelled tokens, their count) from full ``[B, S, V]`` logits."""
    target = labels[:, 1:]
    learned = target != IGNORE_INDEX
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return (lp * learned).sum(1), learned.sum(1).float()


def hf_logps(hf, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hf(input_ids=b["input_ids"], pixel_values=b["pixel_values"], attention_mask=b["attention_mask"]).logits
    return token_logps(logits, b["labels"])


CASES = [(loss, sft, "model") for loss in ("sigmoid", "robust", "hinge", "ipo") for sft in (0.0, 0.5)] + [
    ("sigmoid", 0.5, "lora"),
    ("ipo", 0.0, "lora"),
    ("sigmoid", 0.5, "precomputed"),
    ("hinge", 0.0, "precomputed"),
]


@pytest.mark.parametrize("loss_type,sft_weight,reference", CASES)
def test_step_equals_direct_computation(loss_type, sft_weight, reference):
    torch.set_num_threads(1)
    hf, hf_ref = tiny_llava(seed=0), tiny_llava(seed=1)
    b = pair_batch(hf)
    policy = neva_from_hf(hf)
    if reference == "lora":  # adapters that move the policy away from its base weights (B is zero at init)
        apply_lora(policy, ["wq", "wv", "w2"], rank=4, alpha=8.0, dropout=0.0)
        torch.manual_seed(2)
        for m in policy.modules():
            if isinstance(m, LoRALinear):
                torch.nn.init.normal_(m.lora_b.weight, std=0.05)
    objective = PreferenceObjective(
        DPOConfig(beta=BETA, loss_type=loss_type, label_smoothing=SMOOTHING, sft_weight=sft_weight)
    )
    cpu = torch.device("cpu")
    parallel = ParallelModel([policy], Layout(), None, policy)
    engine = Engine(parallel, Precision(), cpu, packed=False, head=objective, objectives=(objective,))
    batch = neva_batch(b)
    mean = loss_type == "ipo"  # IPO scores token-mean log-probs
    with torch.no_grad():
        if reference == "model":
            ref_model = neva_from_hf(hf_ref).requires_grad_(False)
            objective.reference = reference_forward(engine, ref_model, contextlib.nullcontext, mean)
            ref_sum, ref_n = hf_logps(hf_ref, b)
        elif reference == "lora":
            objective.reference = reference_forward(engine, None, lambda: adapters_disabled(policy), mean)
            ref_sum, ref_n = hf_logps(hf, b)  # adapters off = the HF weights
        else:  # near the policy's own, so that every objective (hinge's margin too) has a gradient
            ref_sum, ref_n = hf_logps(hf, b)
            ref_sum = ref_sum + torch.randn(2 * PAIRS, generator=torch.Generator().manual_seed(3))
    ref = ref_sum / ref_n if mean else ref_sum
    if reference == "precomputed":
        batch = batch.with_stage(ref_logps=ref)

    loss, n_pairs = engine.forward_backward([batch])
    metrics = engine.aux_metrics

    # The direct computation: the policy's log-probs from transformers' logits (LoRA: the model's own full logits).
    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    if reference == "lora":
        sums, counts = token_logps(policy(b["input_ids"], neva_batch(b).media), b["labels"])
        direct_params = params
    else:
        sums, counts = hf_logps(hf, b)
        prefixes = detect_prefixes(hf.state_dict().keys())
        direct_params = {hf_key_to_neva(n, prefixes): p for n, p in hf.named_parameters()}
        direct_params = {n: p for n, p in direct_params.items() if n in params}
    pol = sums / counts if mean else sums
    n = PAIRS
    h = (pol[:n] - pol[n:]) - (ref[:n] - ref[n:])
    total = (direct_losses(loss_type, h).sum() + sft_weight * (-sums[:n] / counts[:n]).sum()) / n
    grads = torch.autograd.grad(total, list(direct_params.values()), allow_unused=True)

    assert int(n_pairs) == PAIRS
    torch.testing.assert_close(loss, total.detach(), rtol=1e-5, atol=1e-6)
    pol = pol.detach()
    chosen, rejected = BETA * (pol[:n] - ref[:n]), BETA * (pol[n:] - ref[n:])
    expected = {
        "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(), "rewards/margin": (chosen - rejected).mean(),
        "logps/chosen": pol[:n].mean(), "logps/rejected": pol[n:].mean(),
        "ref_logps/chosen": ref[:n].mean(), "ref_logps/rejected": ref[n:].mean(),
    }  # fmt: skip
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-4, abs=1e-5), key
    checked = 0
    for (name, _), grad in zip(direct_params.items(), grads):
        ours = params[name].grad
        if grad is None or not grad.abs().sum():
            assert ours is None or not ours.abs().sum(), name
            continue
        torch.testing.assert_close(ours, grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    assert checked > (10 if reference != "lora" else 2)
