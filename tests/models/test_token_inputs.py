"""The per-token inputs of a decoder forward (``neva.models.token_inputs``): an argument narrowed with the rows a
layer computes, handed on only to a layer that reads it, and read by a compiled block without a graph break."""

import torch
from torch import nn

from neva.models.lora import LoRALinear
from neva.models.token_inputs import NO_TOKEN_INPUTS, TokenInputs, project

KEYS = torch.arange(12).view(2, 6)
MASK = torch.arange(12).view(2, 6) % 3 != 0
ROWS = torch.tensor([[0, 1], [1, 4]])


def test_inputs_at_rows_and_unchanged_without_rows():
    inputs = TokenInputs(KEYS, MASK)
    inner = inputs.at(ROWS)
    assert torch.equal(inner.dropout_keys, torch.tensor([1, 10]))
    assert torch.equal(inner.token_mask, torch.tensor([True, True]))
    assert inputs.at(None).dropout_keys is KEYS and inputs.at(None).token_mask is MASK
    assert NO_TOKEN_INPUTS.at(ROWS) == TokenInputs()


def test_only_a_layer_that_reads_them_gets_them():
    torch.manual_seed(0)
    plain = nn.Linear(4, 4)
    calls = []
    plain.register_forward_pre_hook(lambda module, args: calls.append(len(args)))  # a parallel plan's input hook
    x = torch.randn(2, 6, 4)
    assert torch.equal(project(plain, x, TokenInputs(KEYS, MASK)), plain(x)) and calls == [1, 1]
    adapter = LoRALinear(nn.Linear(4, 4), rank=2, alpha=4.0, dropout=0.5, salt=3).train()
    nn.init.normal_(adapter.lora_b.weight)
    keyed = project(adapter, x, TokenInputs(KEYS))
    assert torch.equal(keyed, project(adapter, x, TokenInputs(KEYS)))  # the keys' masks, not the RNG stream's
    assert not torch.equal(keyed, project(adapter, x, TokenInputs(KEYS + 1)))


def test_a_compiled_block_reads_them_in_one_graph():
    """``fullgraph=True`` raises on any graph break: the inputs, their narrowing and a keyed adapter all trace."""
    torch.manual_seed(0)
    adapter = LoRALinear(nn.Linear(3, 3), rank=2, alpha=4.0, dropout=0.5, salt=3).train()
    nn.init.normal_(adapter.lora_b.weight)

    def block(x, inputs, rows):
        narrowed = inputs.at(rows)
        return project(adapter, x[rows[:, 0], rows[:, 1]], narrowed) * narrowed.token_mask[:, None]

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    x = torch.randn(2, 6, 3)
    inputs = TokenInputs(KEYS, MASK)
    assert torch.equal(compiled(x, inputs, ROWS), block(x, inputs, ROWS))
