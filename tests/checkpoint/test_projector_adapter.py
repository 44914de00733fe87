"""``model.mm_cfg.pretrain_mm_mlp_adapter``: LLaVA's published projector file starts the projector (weights only,
shapes checked), for both ``linear`` and ``mlp2x_gelu``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from neva.checkpoint.initial_weights import init_fresh, load_source_weights
from neva.checkpoint.source import resolve_source
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


def test_llava_finetune_flow_starts_from_hf_llm_and_projector_file(tmp_path):
    """LLaVA's finetune: an HF LLM + CLIP and `--pretrain_mm_mlp_adapter`; with the projector frozen, the run's
    `final` holds the file's projector exactly (loaded through the training path, not only the loader)."""
    from neva.checkpoint.neva_format import iter_tensors
    from neva.training.run import run
    from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir, one_thread

    make_llama_dir(tmp_path / "llama")
    make_clip_dir(tmp_path / "clip")
    hf = [
        f"model.mm_cfg.llm.from_pretrained={tmp_path}/llama",
        f"model.mm_cfg.vision_encoder.from_pretrained={tmp_path}/clip",
    ]
    cfg = resolve_source(compose_config(["+stage=pretrain", *hf])).cfg
    reference = llava_projector("mlp2x_gelu", cfg.vision.feature_size, cfg.llm.hidden_size)
    path = tmp_path / "mm_projector.bin"
    torch.save({f"model.mm_projector.{k}": v for k, v in reference.state_dict().items()}, path)
    with one_thread():
        final = run(compose_config([
            "+stage=finetune", *hf, f"model.mm_cfg.pretrain_mm_mlp_adapter={path}", "model.mm_cfg.freeze_projector=true",
            f"exp_manager.exp_dir={tmp_path}/run", "trainer.max_steps=1", "model.micro_batch_size=2",
            "model.global_batch_size=2", "model.data.synthetic_train_samples=8", "model.data.synthetic_val_samples=2",
            "exp_manager.create_tensorboard_logger=false", "trainer.enable_progress_bar=false",
            "trainer.val_check_interval=1000",
        ]))  # fmt: skip
    weights = dict(iter_tensors(final))
    for key, value in reference.state_dict().items():
        assert torch.equal(weights[f"projector.{key}"], value), key
