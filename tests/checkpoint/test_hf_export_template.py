"""An export is served as it was trained: for every template the exported chat template, applied by the HF processor
(images, several turns, system prompt), renders neva's own text and tokens; ``generation_config.json`` stops at the
template's end of turn; configs carry the transformers 4.x spellings and the run's dtype; ``hf-to-neva`` reads the
template back. A transformers 4.46 environment (built once, cached) loads the export and generates neva's tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import load_metadata, load_tokenizer
from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import Message
from neva.data.templates.registry import TEMPLATE_CLASSES, get_template, image_token_for
from neva.inference import Answerer
from neva.models.generation import GenerationConfig, generate
from tests.checkpoint.tiny_hf import make_llava_dir, one_thread
from tests.data import official_templates as official
from tests.pip_site import CACHE, cached_site

REPO = Path(__file__).resolve().parents[2]
U, A, S = "user", "assistant", "system"
IMAGE = Image.new("RGB", (40, 30), (200, 30, 30))
# transformers 4.x as many vLLM / SGLang / lmms-eval installs pin it; tokenizers and hub versions it accepts.
T4_PINS = ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface_hub==0.26.5", "requests", "urllib3", "idna",
           "certifi", "charset_normalizer")  # fmt: skip
T4_CACHE = CACHE / "transformers-4.46.3"


def conversation(name: str) -> tuple[list[dict], list[Message]]:
    """The same conversation as HF processor messages (content parts) and as neva messages."""
    hf = [
        {"role": S, "content": [{"type": "text", "text": "Be brief."}]},
        {"role": U, "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": A, "content": [{"type": "text", "text": "A cat."}]},
        {"role": U, "content": [{"type": "text", "text": "Colour?"}]},
        {"role": A, "content": [{"type": "text", "text": "Black."}]},
    ]
    neva = [Message(S, "Be brief."), Message(U, "<image>\nWhat is it?"), Message(A, "A cat."), Message(U, "Colour?"),
            Message(A, "Black.")]  # fmt: skip
    if name == "plain":  # one caption per image, no system prompt
        return hf[1:3], neva[1:3]
    return hf, neva


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_template")
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the source has no neva template: named by the next test
        make_llava_dir(root / "hf", seed=3)
        return import_llava(root / "hf", root / "ckpt", metadata={"conv_template": "vicuna_v1"})


def with_metadata(ckpt: Path, out: Path, chat_template: str | None = None, **meta) -> Path:
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **meta}))
    if chat_template is not None:
        tok = load_tokenizer(out)
        tok.chat_template = chat_template
        tok.save_pretrained(str(out))
    return out


def neva_ids(tokenizer, template, messages, num_image_tokens, image_token_id) -> list[int]:
    rendered = template.render(messages)
    ids = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens).input_ids
    return [t for i in ids for t in ([i] * num_image_tokens if i == image_token_id else [i])]


# llava-hf's image token is <image>: the Qwen-VL templates (their vision block) are a Qwen-VL export's, refused here
@pytest.mark.parametrize("name", sorted(n for n in TEMPLATE_CLASSES if image_token_for(n) == IMAGE_TOKEN))
def test_exported_chat_template_renders_as_neva_trained(ckpt, tmp_path, name):
    out = export_llava(ckpt, tmp_path / "hf", conv_template=name)
    processor = AutoProcessor.from_pretrained(out)
    tokenizer = load_tokenizer(ckpt)
    template = get_template(name, tokenizer)
    hf_msgs, msgs = conversation(name)
    text = processor.apply_chat_template(hf_msgs, tokenize=False)
    assert text == template.render(msgs).text
    # the same text through the tokenizer (string content), and the served prompt of the last turn
    assert (
        AutoTokenizer.from_pretrained(out).apply_chat_template(
            [{"role": m.role, "content": m.content} for m in msgs], tokenize=False
        )
        == template.render(msgs).text
    )
    prompt = processor.apply_chat_template(hf_msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == template.render_prompt(msgs[:-1])
    # tokens: the processor (BOS added, <image> expanded) gives neva's training ids
    ids = processor(images=[IMAGE], text=text, return_tensors="pt").input_ids[0].tolist()
    cfg = json.loads((out / "config.json").read_text())
    assert ids == neva_ids(tokenizer, template, msgs, cfg["image_seq_length"], cfg["image_token_index"])
    # ...and so does apply_chat_template(tokenize=True), the path of pipeline("image-text-to-text"): one BOS
    with_images = [
        {**m, "content": [{**p, "image": IMAGE} if p["type"] == "image" else p for p in m["content"]]} for m in hf_msgs
    ]
    direct = processor.apply_chat_template(with_images, tokenize=True, return_dict=True)["input_ids"]
    assert list(direct[0]) == ids
    # hf-to-neva reads the template back; neva renders the built-in itself again (BOS from the tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = import_llava(out, tmp_path / "again")
    assert load_metadata(again)["conv_template"] == name
    assert not getattr(load_tokenizer(again), "chat_template", None)


def test_run_settings_are_exported_system_prompt_eot_dtype(ckpt, tmp_path):
    src = with_metadata(ckpt, tmp_path / "ckpt", conv_template="llama_3", system_prompt="Answer briefly.",
                        precision="bf16-mixed")  # fmt: skip
    tok = load_tokenizer(src)
    tok.add_special_tokens({"extra_special_tokens": ["<|eot_id|>"]}, replace_extra_special_tokens=False)
    tok.save_pretrained(str(src))
    out = export_llava(src, tmp_path / "hf")
    processor = AutoProcessor.from_pretrained(out)
    # the run's system prompt is the served default
    text = processor.apply_chat_template([{"role": U, "content": [{"type": "text", "text": "Hi"}]}], tokenize=False)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["text_config"]["rope_theta"] == 10000.0
    assert config["text_config"]["rope_parameters"]["rope_theta"] == 10000.0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (safe_open has no __iter__)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] != "TokenizersBackend"  # 4.x: "does not exist"
    assert not isinstance(tok_config.get("extra_special_tokens"), list)  # 4.47+: "'list' has no attribute 'keys'"
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|eot_id|>") == gen["eos_token_id"][1]
    assert (out / "chat_template.json").is_file() and (out / "chat_template.jinja").is_file()
    again = import_llava(out, tmp_path / "again")
    assert {k: load_metadata(again)[k] for k in ("conv_template", "system_prompt")} == {
        "conv_template": "llama_3",
        "system_prompt": "Answer briefly.",
    }


def test_tokenizer_own_chat_template_is_exported(ckpt, tmp_path):
    src = with_metadata(ckpt, tmp_path / "ckpt", official.QWEN2_5, conv_template="chatml")
    out = export_llava(src, tmp_path / "hf")
    processor = AutoProcessor.from_pretrained(out)
    hf_msgs, msgs = conversation("chatml")
    template = get_template("chatml", load_tokenizer(src))
    assert processor.apply_chat_template(hf_msgs, tokenize=False) == template.render(msgs).text
    # without a system message: Qwen's own default, as training rendered it
    assert "You are Qwen" in processor.apply_chat_template(hf_msgs[1:], tokenize=False)
    again = import_llava(out, tmp_path / "again")
    assert get_template("chatml", load_tokenizer(again)).render(msgs).text == template.render(msgs).text


def transformers_4_site() -> Path:
    """A transformers 4.46 install (``pip --target``), built once per cache directory; skip when pip cannot."""
    return cached_site(T4_CACHE.name, T4_PINS)


T4_SCRIPT = r"""
import json, sys
import torch, transformers
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration
assert transformers.__version__.startswith("4.46"), transformers.__version__
out, messages = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
processor = AutoProcessor.from_pretrained(out)
tokenizer = AutoTokenizer.from_pretrained(out)
model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
model.eval()
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(images=[Image.new("RGB", (40, 30), (200, 30, 30))], text=prompt, return_tensors="pt")
with torch.no_grad():
    gen = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
print(json.dumps({"prompt": prompt, "tokenizer_prompt": tokenizer.apply_chat_template(
    [{"role": "user", "content": "<image>\nWhat is it?"}], add_generation_prompt=True, tokenize=False),
    "rope_theta": model.config.text_config.rope_theta, "ids": inputs["input_ids"][0].tolist(),
    "new": gen[0, inputs["input_ids"].shape[1]:].tolist()}))
"""


def test_export_loads_and_generates_the_same_under_transformers_4(ckpt, tmp_path):
    site = transformers_4_site()
    src = with_metadata(ckpt, tmp_path / "ckpt", conv_template="vicuna_v1", precision="32")
    out = export_llava(src, tmp_path / "hf")
    hf_msgs = [{"role": U, "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", T4_SCRIPT, str(out), json.dumps(hf_msgs)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    # neva: the checkpoint's own template and tokens, greedy
    answerer = Answerer(src, GenerationConfig(max_new_tokens=6))
    ids, pixels, *_ = answerer.prepare(("What is it?", [IMAGE]))
    assert (
        got["prompt"]
        == got["tokenizer_prompt"]
        == answerer.builder.template.render_prompt([Message(U, "<image>\nWhat is it?")])
    )
    assert got["ids"] == ids and got["rope_theta"] == 10000.0
    with torch.no_grad():
        neva_new = generate(answerer.model, [ids], pixels, [1], GenerationConfig(max_new_tokens=6))[0]
        # transformers 5 on the same export
        model = LlavaForConditionalGeneration.from_pretrained(out).eval()
        processor = AutoProcessor.from_pretrained(out)
        inputs = processor(images=[IMAGE], text=got["prompt"], return_tensors="pt")
        t5 = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
    assert got["new"] == t5
    assert neva_new == t5[: len(neva_new)]  # neva stops at EOS, transformers was told to go on
