"""Decoder families through the HF files: standalone Qwen2 / Mistral LLM directories for stage 1 (import and
``--llm``-style weight loading), and llava-hf exports that transformers 4.46 reloads with the same logits."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from neva.checkpoint.hf_assemble import import_llm_and_vision, load_hf_weights
from neva.checkpoint.hf_export import save_llava_hf
from neva.checkpoint.neva_format import iter_tensors, load_config
from neva.models.media import image_media
from neva.models.neva import NevaModel
from tests.checkpoint.test_hf_export_template import transformers_4_site
from tests.checkpoint.tiny_hf import SP_VOCAB, make_clip_dir, make_tokenizer, one_thread
from tests.hf_oracle import TEXT_KW, neva_from_hf, tiny_llava
from tests.models.test_families import FAMILIES
from tests.models.test_hf_parity import image_prompt, rel_err

LLMS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=8, head_dim=16)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),  # q / k norms
}


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip")
    make_clip_dir(directory)
    return directory


@pytest.mark.parametrize("name", list(LLMS))
def test_standalone_llm_directory_imports_with_its_family(name, clip_dir, tmp_path):
    config_cls, model_cls, extra = LLMS[name]
    tokenizer = make_tokenizer(tmp_path / "llm" / "_sp", vision_tokens=False)
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**TEXT_KW, "vocab_size": SP_VOCAB, **extra})).eval()
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            if param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(tmp_path / "llm"))
    tokenizer.save_pretrained(str(tmp_path / "llm"))

    ckpt = import_llm_and_vision(tmp_path / "llm", clip_dir, tmp_path / "ckpt")
    cfg = load_config(ckpt)
    assert cfg.llm.family == name
    assert cfg.llm.sliding_window == extra.get("sliding_window")
    assert cfg.llm.qkv_bias == (name == "qwen2")
    model = NevaModel(cfg).eval()
    model.load_state_dict(dict(iter_tensors(ckpt)), strict=not cfg.llm.tie_word_embeddings)
    # The other stage-1 path (model.mm_cfg.llm.from_pretrained): weights copied into a built model.
    loaded = NevaModel(cfg).eval()
    load_hf_weights(loaded, tmp_path / "llm")
    ids = torch.randint(3, SP_VOCAB, (1, 21))  # longer than Mistral's window of 8
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        for ours in (model, loaded):
            assert rel_err(ours(ids)[..., :SP_VOCAB], expected) < 1e-5


T4_LOGITS = r"""
import json, sys
import torch, transformers
from transformers import LlavaForConditionalGeneration
assert transformers.__version__.startswith("4.46"), transformers.__version__
torch.set_num_threads(1)
for out in json.loads(sys.argv[1]):
    model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (out, info)
    inputs = torch.load(out + "/inputs.pt")
    with torch.no_grad():
        torch.save(model.eval()(**inputs).logits, out + "/logits_t4.pt")
"""


def test_exports_reload_in_transformers_4_with_identical_logits(tmp_path):
    site = transformers_4_site()
    outs, models = [], {}
    for name in ("qwen2_tied", "mistral_window", "llama3_tied"):
        cls, extra = FAMILIES[name]
        hf = tiny_llava(
            seed=4, text_kw=extra, text_cls=cls, tie_word_embeddings=extra.get("tie_word_embeddings", False)
        )
        ours = neva_from_hf(hf)
        out = save_llava_hf(tmp_path / name, ours.cfg, ours.state_dict())
        ids = image_prompt(ours.cfg.num_image_tokens, ours.cfg.image_token_id, 1, 9, seed=6)[None]
        inputs = dict(input_ids=ids, pixel_values=torch.randn(1, 3, 28, 28))
        torch.save(inputs, out / "inputs.pt")
        outs.append(str(out))
        models[str(out)] = (ours, inputs)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", T4_LOGITS, json.dumps(outs)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for out, (ours, inputs) in models.items():
        with torch.no_grad():
            expected = ours(inputs["input_ids"], image_media(inputs["pixel_values"]))
        assert rel_err(torch.load(out + "/logits_t4.pt"), expected) < 1e-5, out
        assert (
            json.loads((tmp_path / out / "config.json").read_text())["text_config"]["model_type"] == ours.cfg.llm.family
        )
