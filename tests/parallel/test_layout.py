"""Layout resolution, chunking and divisibility checks (single process, fast)."""

from __future__ import annotations

import pytest

from neva.config import compose_config
from neva.models.presets import build_config
from neva.models.trainable import LoraSpec, TrainablePolicy, build_meta_model
from neva.parallel.layout import mesh_coords, resolve_layout
from neva.parallel.pipeline import check_deepstack_split, local_chunks, split_layers
from neva.parallel.stage_owners import chunk_of_key
from neva.parallel.tensor_parallel import check_divisibility, tp_shard_dims
from neva.typed import ConfigError


def _cfg(*overrides: str):
    return compose_config(["+stage=pretrain", *overrides])


def test_layout_from_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    layout = resolve_layout(_cfg("model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"))
    assert (layout.world, layout.tp, layout.pp, layout.dp) == (8, 2, 2, 2)
    assert mesh_coords(5, layout) == (1, 0, 0, 1)
    assert layout.dp_rank == 0


def test_context_parallel_sits_between_dp_and_tp(monkeypatch):
    """world = pp × dp × cp × tp, tp fastest then cp: the cp ranks of one dp rank share its dp rank (and data)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "6")
    layout = resolve_layout(_cfg("model.tensor_model_parallel_size=2", "model.context_parallel_size=2"))
    assert (layout.world, layout.tp, layout.cp, layout.dp, layout.dp_cp) == (8, 2, 2, 2, 4)
    assert [mesh_coords(r, layout) for r in (0, 1, 2, 5, 6)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 0)
    ]  # fmt: skip
    assert layout.dp_rank == 1
    with pytest.raises(ConfigError, match=r"model.context_parallel_size \(4\)"):
        resolve_layout(_cfg("model.tensor_model_parallel_size=4", "model.context_parallel_size=4"))


def test_layout_from_slurm_and_devices(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    layout = resolve_layout(_cfg("model.tensor_model_parallel_size=2"))
    assert (layout.world, layout.tp, layout.pp, layout.dp, layout.dp_rank) == (4, 2, 1, 2, 1)
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.delenv("SLURM_PROCID")
    assert resolve_layout(_cfg("trainer.devices=2")).dp == 2


def test_non_divisible_layout_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_layout(_cfg("model.tensor_model_parallel_size=4"))


def test_tp_divisibility_names_the_field():
    cfg = build_config("tiny")  # 4 heads, 2 kv heads
    check_divisibility(cfg, 2)
    with pytest.raises(ConfigError, match="num_kv_heads=2"):
        check_divisibility(cfg, 4)


def test_tp_shard_dims_follow_the_plan():
    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("wq", "wo"))
    dims = tp_shard_dims(build_meta_model(build_config("tiny"), TrainablePolicy(lora=lora)))
    layer = "llm.layers.1."
    assert dims[layer + "attention.wq.base.weight"] == dims[layer + "attention.wq.lora_b.weight"] == 0  # column
    assert dims[layer + "attention.wo.base.weight"] == dims[layer + "attention.wo.lora_a.weight"] == 1  # row
    assert dims[layer + "attention.wq.lora_a.weight"] is dims[layer + "attention.wo.lora_b.weight"] is None
    assert dims[layer + "feed_forward.w2.weight"] == 1 and dims[layer + "ffn_norm.weight"] is None
    assert dims["llm.tok_embeddings.weight"] == dims["llm.output.weight"] == 0  # vocab parallel
    assert (dims["projector.0.weight"], dims["projector.0.bias"], dims["projector.2.weight"]) == (0, 0, 1)
    assert dims["projector.2.bias"] is None
    assert all(d is None for n, d in dims.items() if n.startswith("vision."))


def test_deepstack_layers_stay_on_the_first_pipeline_chunk():
    """Qwen3-VL's DeepStack features are made on the first chunk: a split putting layer 0 or 1 elsewhere is refused
    naming the key that moves it; q / k norms stay replicated under TP (their gradients all-reduced)."""
    cfg = build_config("tiny_qwen3", "tiny_qwen3_vl", "qwen3_vl_merger", mrope_section=[8, 4, 4])
    assert cfg.deepstack_layers == 2
    check_deepstack_split(cfg, split_layers(4, 2))
    with pytest.raises(ConfigError, match=r"layers 0\.\.1 .*pipeline_first_stage_layers >= 2"):
        check_deepstack_split(cfg, split_layers(4, 2, first_chunk_layers=1))
    dims = tp_shard_dims(build_meta_model(cfg, TrainablePolicy()))
    assert dims["llm.layers.0.attention.q_norm.weight"] is dims["llm.layers.0.attention.k_norm.weight"] is None
    assert dims["projector.deepstack.1.fc1.weight"] == 0 and dims["projector.deepstack.1.fc2.weight"] == 1


def test_pipeline_chunks():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 2) == [[0, 1], [2, 3, 4]]
    assert split_layers(6, 3, first_chunk_layers=1) == [[0], [1, 2], [3, 4, 5]]
    with pytest.raises(ConfigError):
        split_layers(2, 4)
    assert local_chunks(1, 2, 2) == [1, 3]
    split = split_layers(4, 4)
    assert chunk_of_key("vision.cls_token", split) == 0
    assert chunk_of_key("llm.layers.2.ffn_norm.weight", split) == 2
    assert chunk_of_key("llm.output.weight", split) == 3
