"""The per-token inputs of a decoder forward (``neva.models.token_inputs``): what layers see, and that a compiled
block reads them without a graph break."""

import torch

from neva.models.token_inputs import TokenInputs, current_token_inputs, token_inputs, token_inputs_at

KEYS = torch.arange(12).view(2, 6)
MASK = torch.arange(12).view(2, 6) % 3 != 0
ROWS = torch.tensor([[0, 1], [1, 4]])


def test_layers_see_the_inputs_at_rows_and_the_previous_inputs_after():
    assert current_token_inputs() == TokenInputs()
    with token_inputs(TokenInputs(KEYS, MASK)):
        with token_inputs_at(ROWS):
            inner = current_token_inputs()
        with token_inputs_at(None):
            assert current_token_inputs().dropout_keys is KEYS
    assert torch.equal(inner.dropout_keys, torch.tensor([1, 10]))
    assert torch.equal(inner.token_mask, torch.tensor([True, True]))
    assert current_token_inputs() == TokenInputs()


def test_a_compiled_block_reads_them_in_one_graph():
    """A ``ContextVar.get`` would break the graph: ``fullgraph=True`` raises on any break."""

    def block(x, rows):
        with token_inputs_at(rows):
            inputs = current_token_inputs()
            return x * inputs.token_mask + inputs.dropout_keys

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    x = torch.randn(2)
    with token_inputs(TokenInputs(KEYS, MASK)):
        assert torch.equal(compiled(x, ROWS), block(x, ROWS))
