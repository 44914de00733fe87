"""``model.mm_cfg.pretrain_mm_mlp_adapter``: LLaVA's published projector file starts the projector (weights only,
shapes checked), for both ``linear`` and ``mlp2x_gelu``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from neva.checkpoint.source import init_fresh, load_source_weights, resolve_source
from neva.config import compose_config
from neva.models.neva import NevaModel
from neva.typed import ConfigError


def llava_projector(kind: str, mm_hidden: int, hidden: int) -> nn.Module:
    """The projector as LLaVA's ``build_vision_projector`` makes it (a bare Linear for ``linear``)."""
    torch.manual_seed(7)
    if kind == "linear":
        return nn.Linear(mm_hidden, hidden)
    return nn.Sequential(nn.Linear(mm_hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))


def source_for(path, kind: str, *extra: str):
    return resolve_source(
        compose_config(["+stage=pretrain", f"model.mm_cfg.mm_mlp_adapter_type={kind}",
                        f"model.mm_cfg.pretrain_mm_mlp_adapter={path}", *extra])
    )  # fmt: skip


@pytest.mark.parametrize("kind,fmt", [("mlp2x_gelu", "bin"), ("linear", "safetensors")])
def test_llava_projector_file_starts_the_projector(tmp_path, kind, fmt):
    plain = resolve_source(compose_config(["+stage=pretrain", f"model.mm_cfg.mm_mlp_adapter_type={kind}"]))
    cfg = plain.cfg
    reference = llava_projector(kind, cfg.vision.feature_size, cfg.llm.hidden_size)
    # What LLaVA's pretrain writes: the `mm_projector` parameters of LlavaLlamaForCausalLM, under their full names.
    state = {f"model.mm_projector.{k}": v.clone() for k, v in reference.state_dict().items()}
    path = tmp_path / f"mm_projector.{fmt}"
    if fmt == "bin":
        torch.save(state, path)
    else:
        save_file(state, str(path))
    source = source_for(path, kind)
    model = NevaModel(source.cfg)
    init_fresh(model, torch.device("cpu"), seed=0)
    before = model.llm.tok_embeddings.weight.clone()
    load_source_weights([model], source)
    features = torch.randn(2, 5, cfg.vision.feature_size)
    torch.testing.assert_close(model.projector(features), reference(features), rtol=0, atol=0)
    assert torch.equal(model.llm.tok_embeddings.weight, before)  # only the projector was loaded


def test_wrong_projector_files_are_refused_by_name(tmp_path):
    cfg = resolve_source(compose_config(["+stage=pretrain"])).cfg
    reference = llava_projector("mlp2x_gelu", cfg.vision.feature_size + 1, cfg.llm.hidden_size)  # another tower
    path = tmp_path / "mm_projector.bin"
    torch.save({f"model.mm_projector.{k}": v for k, v in reference.state_dict().items()}, path)
    model = NevaModel(cfg)
    init_fresh(model, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match=r"projector\.0\.weight.*\(\d+, \d+\)"):
        load_source_weights([model], source_for(path, "mlp2x_gelu"))
    with pytest.raises(ValueError, match="mm_mlp_adapter_type"):  # an mlp2x_gelu file for a linear projector
        load_source_weights([model], source_for(path, "linear"))
    with pytest.raises(ConfigError, match="no such file"):
        source_for(tmp_path / "missing.bin", "mlp2x_gelu")
    with pytest.raises(ConfigError, match="restore_from_path"):
        source_for(path, "mlp2x_gelu", f"model.restore_from_path={tmp_path}")
