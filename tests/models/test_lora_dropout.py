"""LoRA adapter dropout keyed by sample and position: the same sample gets the same mask wherever it sits."""

import pytest
import torch
from torch import nn

from neva.models.lora import LoRALinear, keyed_dropout_mask, token_dropout_keys
from neva.models.token_inputs import TokenInputs

FEATURES = 64


def _rows(samples: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per list of samples, packed left to right and right-padded with 0s (positions 0 on padding)."""
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    pos = torch.zeros(len(samples), length, dtype=torch.long)
    for r, row in enumerate(samples):
        at = 0
        for sample in row:
            ids[r, at : at + len(sample)] = torch.tensor(sample)
            pos[r, at : at + len(sample)] = torch.arange(len(sample))
            at += len(sample)
    return ids, pos


A, B, C = [5, 9, 2, 7, 7, 3], [11, 4, 4], [8, 1, 6, 6, 2]


def test_a_sample_keeps_its_keys_in_any_row_batch_or_padding():
    ids, pos = _rows([[A], [B, C]], 16)
    keys = token_dropout_keys(ids, pos, step=3)
    alone_ids, alone_pos = _rows([[C, A]], 12)  # A packed after another sample, shorter padding
    alone = token_dropout_keys(alone_ids, alone_pos, step=3)
    assert torch.equal(keys[0, : len(A)], alone[0, len(C) : len(C) + len(A)])
    assert torch.equal(keys[1, len(B) : len(B) + len(C)], alone[0, : len(C)])
    assert not torch.equal(keys[0, : len(A)], token_dropout_keys(ids, pos, step=4)[0, : len(A)])  # new step
    assert len(set(keys[0, : len(A)].tolist())) == len(A)  # every position its own mask


def test_keyed_mask_rate_and_layers_differ():
    keys = token_dropout_keys(*_rows([[list(range(1, 200))]], 199), step=0)
    mask = keyed_dropout_mask(keys, 512, salt=1, p=0.1)
    assert 0.88 < mask.float().mean().item() < 0.92
    assert not torch.equal(mask, keyed_dropout_mask(keys, 512, salt=2, p=0.1))


def test_lora_layer_output_for_a_sample_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(FEATURES, FEATURES), rank=4, alpha=8.0, dropout=0.3, salt=7)
    nn.init.normal_(layer.lora_b.weight)
    layer.train()
    x_a = torch.randn(len(A), FEATURES)

    def run(samples, length, at):
        ids, pos = _rows(samples, length)
        x = torch.randn(len(samples), length, FEATURES)
        x[at[0], at[1] : at[1] + len(A)] = x_a
        keys = token_dropout_keys(ids, pos, step=1)
        return layer(x, token_inputs=TokenInputs(dropout_keys=keys))[at[0], at[1] : at[1] + len(A)]

    first = run([[A], [B, C]], 16, (0, 0))
    second = run([[B], [C, A]], 12, (1, len(C)))
    assert torch.allclose(first, second, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # and dropout did drop something
        assert not torch.allclose(first, layer.base(x_a) + layer.lora_b(layer.lora_a(x_a)) * layer.scale)


def test_without_keys_or_in_eval_dropout_is_plain():
    layer = LoRALinear(nn.Linear(FEATURES, FEATURES), rank=4, alpha=8.0, dropout=0.5)
    x = torch.randn(3, 5, FEATURES)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    nn.init.normal_(layer.lora_b.weight)
    assert not torch.equal(layer(x), layer(x))  # the RNG stream's dropout


@pytest.mark.parametrize("p", [0.0, 0.05])
def test_zero_dropout_is_identity(p):
    layer = LoRALinear(nn.Linear(FEATURES, FEATURES), rank=4, alpha=8.0, dropout=p).train()
    x = torch.randn(2, 3, FEATURES)
    ids, pos = _rows([[A[:3]], [B]], 3)
    out = layer._dropout(x, token_dropout_keys(ids, pos, 0))
    assert torch.equal(out, x) == (p == 0.0)
