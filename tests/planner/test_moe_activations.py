"""The planner's MoE activation term (``neva.planner.activations._ffn_elements``) against what autograd really saves
for backward in a real MoE feed-forward (``neva.models.moe``, tiny, bf16, CPU): the hidden- and intermediate-sized
tensors of the dispatch and the experts, frozen (pretrain) and trained."""

from __future__ import annotations

import pytest
import torch

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.models.moe import MoEFeedForward
from neva.planner.activations import _ffn_elements


def _saved_bytes(moe: MoEFeedForward, x: torch.Tensor, widths: set[int]) -> int:
    """Bytes of the distinct storages autograd saves in ``moe``'s forward whose last dimension is one of ``widths``
    (parameters excluded: they are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in moe.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.dim() and t.shape[-1] in widths:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return sum(storages.values())


@pytest.mark.parametrize("trains", [False, True], ids=["frozen", "trained"])
def test_moe_saved_activations_are_the_planned_ones(trains: bool) -> None:
    cfg = neva_config_from_mm(compose_config(["+stage=pretrain", "model=tiny_moe"]).model.mm_cfg)
    llm, tokens, e = cfg.llm, 48, 2
    torch.manual_seed(0)
    moe = MoEFeedForward(llm).to(torch.bfloat16)
    moe.reset_parameters()
    moe.requires_grad_(trains)
    x = torch.randn(1, tokens, llm.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved_bytes(moe, x, {llm.hidden_size, llm.intermediate_size})
    f, d = _ffn_elements(cfg, tokens, tp=1)
    # frozen: the experts' SwiGLU (w1 x, silu(w1 x), w3 x) and the two dispatched tensors; trained also the rows
    # grouped by expert (w1 / w3 input), w2's input and the router's input (the layer input, which the planner
    # counts with the dense layer's feed-forward input)
    planned = e * (3 * f + 2 * d) + (e * (f + d) + e * tokens * llm.hidden_size if trains else 0)
    assert saved == planned
