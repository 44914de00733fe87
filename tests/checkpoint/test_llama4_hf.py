"""Llama 4's decoder against transformers' own ``Llama4ForCausalLM`` (a tiny random model built here, fp32, CPU):
``neva.convert hf-to-neva``, logits on a 20-token batch with 8-token attention chunks (chunked RoPE layers, NoPE
layers with temperature tuning, a dense and an MoE layer each), packed rows equal to each sample alone, greedy
generation equal to ``generate`` on a left-padded batch, ``neva-to-hf`` → reload with identical logits, and the
multimodal class refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from neva.checkpoint.neva_format import load_model
from neva.models.generation import GenerationConfig, generate
from neva.models.neva import NevaModel
from tests.checkpoint.tiny_hf import one_thread
from tests.models.test_hf_parity import rel_err

CHUNK = 8
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.1,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
)  # fmt: skip
"""Layers: 0 chunked RoPE + dense, 1 NoPE global + MoE, 2 chunked + dense, 3 NoPE + MoE; temperature tuning from
position 3 on (floor_scale 4, Llama 4's is 8192)."""


def _hf(**overrides):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    return Llama4ForCausalLM(Llama4TextConfig(**{**TEXT, **overrides})).eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from neva.convert import main

    root = tmp_path_factory.mktemp("llama4")
    with one_thread():
        hf = _hf()
        hf.save_pretrained(str(root / "hf"))
        main(["hf-to-neva", "--hf", str(root / "hf"), "--out", str(root / "neva")])
        model = load_model(root / "neva").eval()
    return hf, root, model


def _ids(batch: int = 2, length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, TEXT["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def test_import_reads_every_llama4_trait(imported):
    _, _, model = imported
    llm = model.cfg.llm
    assert (llm.family, llm.attention_chunk_size, llm.nope_layers, llm.moe_layer_freq) == (
        "llama4_text",
        CHUNK,
        [1, 3],
        [0, 1, 0, 1],
    )
    assert llm.qk_l2_norm and llm.attn_temperature_floor_scale == 4 and llm.dense_intermediate_size == 24  # fmt: skip


def test_logits_equal_transformers(imported):
    hf, _, model = imported
    ids = _ids()
    with one_thread(), torch.no_grad():
        expected = hf(input_ids=ids).logits
        ours = model(ids)
        assert rel_err(ours, expected) < 1e-5
        # each trait matters on this prompt: without it neva computes another model
        for change in (dict(attention_chunk_size=None, layer_types=None), dict(attn_temperature_floor_scale=None),
                       dict(nope_layers=None), dict(qk_l2_norm=False),
                       # the family's own check refuses output-scaled routing: Mixtral's family computes it
                       dict(moe_apply_probs_on_input=False, family="mixtral")):  # fmt: skip
            cfg = dataclasses.replace(model.cfg, llm=dataclasses.replace(model.cfg.llm, **change))
            other = NevaModel(cfg).eval()
            other.load_state_dict(model.state_dict())
            assert rel_err(other(ids), expected) > 1e-4, change  # ten times the tolerance, at least


def test_packed_row_equals_each_sample_alone(imported):
    """Two samples (11 and 13 tokens) in one row: chunks count from each sample's start, positions restart."""
    hf, _, model = imported
    a, b = _ids(1, 11, 1)[0], _ids(1, 13, 2)[0]
    ids = torch.cat([a, b])[None]
    segments = torch.cat([torch.full((11,), 1), torch.full((13,), 2)])[None]
    positions = torch.cat([torch.arange(11), torch.arange(13)])[None]
    with one_thread(), torch.no_grad():
        row = model(ids, position_ids=positions, segment_ids=segments)[0]
        assert rel_err(row[:11], hf(input_ids=a[None]).logits[0]) < 1e-5
        assert rel_err(row[11:], hf(input_ids=b[None]).logits[0]) < 1e-5


def test_greedy_generation_equals_transformers_left_padded(tmp_path):
    """Prompts of 19, 12 and 5 tokens, left-padded, 10 new tokens: chunk boundaries cross during decoding. Llama 4's
    own floor_scale (8192): transformers scales a left-padded row's queries by its columns, neva by each token's
    position in its sample, the same factor below floor_scale (neva.models.llama._temperature)."""
    from neva.checkpoint.hf_llama4 import llama4_parts

    with one_thread():
        hf = _hf(floor_scale=8192)
        hf.save_pretrained(str(tmp_path / "hf"))
        cfg, tensors, _, _ = llama4_parts(tmp_path / "hf")
        model = NevaModel(cfg).eval()
        model.load_state_dict(dict(tensors))
        prompts = [_ids(1, n, n)[0].tolist() for n in (19, 12, 5)]
        ours = generate(model, prompts, config=GenerationConfig(max_new_tokens=10, pad_token_id=0))
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    assert ours == out[:, width:].tolist()


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import Llama4ForCausalLM

    from neva.convert import main

    hf, root, _ = imported
    out = tmp_path / "export"
    with one_thread():
        main(["neva-to-hf", "--ckpt", str(root / "neva"), "--out", str(out), "--dtype", "float32"])
        assert json.loads((out / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
        reloaded, info = Llama4ForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        ids = _ids(2, 20, 3)
        with torch.no_grad():
            assert torch.equal(reloaded.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)
        main(["hf-to-neva", "--hf", str(out), "--out", str(tmp_path / "again")])
    again, first = load_model(tmp_path / "again").state_dict(), load_model(root / "neva").state_dict()
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_multimodal_class_and_unknown_fields_refused_in_one_line(tmp_path, capsys):
    from neva.convert import main

    for name, config, says in (
        ("mm", {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}, "vision tower"),
        ("jitter", {**TEXT, "model_type": "llama4_text", "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("unknown", {**TEXT, "model_type": "llama4_text", "some_new_field": 1}, "some_new_field=1"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(SystemExit) as exit_info:
            main(["hf-to-neva", "--hf", str(tmp_path / name), "--out", str(tmp_path / f"{name}_out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err and says in err, err


def test_export_refuses_what_llama4_cannot_express():
    from neva.checkpoint.hf_llama4 import LLAMA4_INTEROP
    from neva.models.config import NevaConfig
    from neva.models.presets import build_config
    from neva.typed import ConfigError

    llm = build_config("tiny_llama4").llm
    text = NevaConfig(llm=llm, vision=None, projector=None, image_token_id=llm.vocab_size)
    assert LLAMA4_INTEROP.round_trip(text) == "llama4_text"
    for change, says in ((dict(rotary_percent=0.5), "rotary_percent"), (dict(qk_norm=True), "qk_norm")):
        with pytest.raises(ConfigError, match=says):
            LLAMA4_INTEROP.round_trip(dataclasses.replace(text, llm=dataclasses.replace(llm, **change)))
    with pytest.raises(ConfigError, match="no vision side yet"):  # a Llama 4 decoder behind another tower
        LLAMA4_INTEROP.round_trip(build_config("tiny_llama4"))
