"""``model.loss_normalization`` against hand-computed objectives on micro-batches with uneven learned-token counts:
one process here, two data-parallel gloo processes in ``tests/parallel/test_loss_normalization.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neva.constants import IGNORE_INDEX
from neva.training.engine import model_inputs
from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine


def _hf_mean_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's causal-LM loss of one micro-batch (mean over its learned tokens), its summed loss and its token count."""
    logits = model(**model_inputs(batch, torch.device("cpu"), packed=False)).float()
    targets = batch.labels[:, 1:].reshape(-1)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    mean = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return mean, total, (targets != IGNORE_INDEX).sum()


@pytest.mark.parametrize("normalization", ["micro_batch_mean", "global_tokens"])
def test_step_objective_and_gradients_match_the_hand_computed_loss(lean_cfg, normalization):
    torch.manual_seed(0)
    cfg = lean_cfg(
        "model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1",
        f"model.loss_normalization={normalization}",
    )  # fmt: skip
    source, batches = micro_batches(cfg, 3, 2)
    engine = make_engine(cfg, source)
    model = engine.model
    params = [p for p in model.parameters() if p.requires_grad]

    parts = [_hf_mean_loss(model, mb) for mb in batches]
    counts = [int(n) for _, _, n in parts]
    assert len(set(counts)) > 1, counts  # uneven learned tokens: the two normalisations differ
    if normalization == "micro_batch_mean":  # LLaVA / HF with accumulation: the mean of the micro-batch means
        expected = sum(mean for mean, _, _ in parts) / len(parts)
    else:  # every learned token of the global batch weighs the same
        expected = sum(total for _, total, _ in parts) / sum(counts)
    other = (
        sum(total for _, total, _ in parts) / sum(counts)
        if normalization == "micro_batch_mean"
        else sum(mean for mean, _, _ in parts) / len(parts)
    )
    assert abs(float((expected - other).detach())) > 1e-4 * float(expected.detach())
    ref_grads = torch.autograd.grad(expected, params)

    loss, tokens = engine.forward_backward(batches)
    assert int(tokens) == sum(counts)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    for p, ref in zip(params, ref_grads):
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-7)


def test_unknown_normalization_is_refused(lean_cfg):
    with pytest.raises(Exception, match="loss_normalization"):
        lean_cfg("model.loss_normalization=mean")
