"""What an HF export carries besides weights: the chat template neva trained with, its end-of-turn stops, and the
file entries transformers 4.x reads.

The chat template is written where each reader looks: ``chat_template.jinja`` (transformers 5 processor and
tokenizer), ``chat_template.json`` (transformers 4.4x processor) and ``tokenizer_config.json``'s ``chat_template``
(transformers 4.x tokenizer, vLLM). Its first line is a Jinja comment holding neva's template settings as JSON, so
``hf-to-neva`` reads the template back instead of falling back to a default.

transformers 5 writes a few entries 4.x cannot read: ``tokenizer_class: TokenizersBackend`` (4.x: "does not exist"),
``rope_parameters`` only (4.x reads ``rope_theta`` / ``rope_scaling`` and silently uses theta 10000 without them),
``dtype`` only (4.x reads ``torch_dtype``), ``extra_special_tokens`` as a list (4.47+ wants a dict), the image processor nested in ``processor_config.json`` (4.x passes it to
``LlavaProcessor`` a second time). Both spellings are written; the image processor stays in its own file, which both
read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from neva.data.jinja_templates import chat_template_for
from neva.data.templates.base import end_of_turn_ids
from neva.data.templates.chat_template import ChatTemplateRenderer
from neva.data.templates.registry import DEFAULT_TEMPLATE, get_template
from neva.models.config import NevaConfig

CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
PROCESSOR_CONFIG = "processor_config.json"
_MARK = re.compile(r"\A\{#- neva (.*?) -#\}", re.DOTALL)
# Tokenizer classes of transformers 5 that 4.x does not know, and the 4.x class that loads the same tokenizer.json.
_TOKENIZER_CLASS_4X = {"TokenizersBackend": "PreTrainedTokenizerFast"}
# The run's precision → the dtype its export is written in (the weights a bf16 run trained are bf16 weights).
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def template_settings(metadata: dict[str, Any], conv_template: str | None = None) -> dict[str, Any]:
    """The template settings a neva checkpoint was trained (or imported) with: template name, system prompt and
    whether the tokenizer's own chat template rendered; ``conv_template`` overrides the recorded name."""
    return {
        "conv_template": conv_template or metadata.get("conv_template") or DEFAULT_TEMPLATE,
        "system_prompt": metadata.get("system_prompt"),
        "use_chat_template": bool(metadata.get("use_chat_template", True)),
    }


def export_chat_template(settings: dict[str, Any], tokenizer: Any) -> str:
    """The Jinja chat template of an export, its first line marking neva's settings (``read_template_settings``)."""
    name = settings["conv_template"]
    body = chat_template_for(name, tokenizer, settings["use_chat_template"], settings["system_prompt"])
    builtin = not isinstance(get_template(name, tokenizer, settings["use_chat_template"]), ChatTemplateRenderer)
    mark = json.dumps({**settings, "builtin": builtin}, ensure_ascii=True)
    return "{#- neva " + mark.replace("#}", "#\\u007d") + " -#}" + body  # a JSON escape keeps "#}" out of the comment


def read_template_settings(directory: Path) -> dict[str, Any] | None:
    """neva's template settings from an HF directory's chat template (None when it has no neva-written one)."""
    for text in _chat_templates(directory):
        match = _MARK.match(text)
        if match:
            return json.loads(match.group(1))
    return None


def _chat_templates(directory: Path) -> list[str]:
    found = []
    if (directory / CHAT_TEMPLATE_JINJA).is_file():
        found.append((directory / CHAT_TEMPLATE_JINJA).read_text())
    for name in (CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG):
        if (directory / name).is_file():
            value = json.loads((directory / name).read_text()).get("chat_template")
            if isinstance(value, str):
                found.append(value)
    return found


def generation_eos_ids(settings: dict[str, Any], tokenizer: Any) -> int | list[int] | None:
    """``eos_token_id`` for ``generation_config.json``: EOS plus the template's end-of-turn token (llama_3's
    ``<|eot_id|>``, chatml's ``<|im_end|>``), as ``neva.generate`` stops."""
    template = get_template(settings["conv_template"], tokenizer, settings["use_chat_template"])
    ids = list(end_of_turn_ids(template, tokenizer))
    return ids[0] if len(ids) == 1 else (ids or None)


def export_dtype(metadata: dict[str, Any]) -> torch.dtype | None:
    """The dtype a checkpoint exports in by default: its run's half precision (``bf16-mixed`` → bfloat16), else
    None (keep the stored dtypes)."""
    precision = str(metadata.get("precision", ""))
    return next((dtype for prefix, dtype in _PRECISION_DTYPES.items() if precision.startswith(prefix)), None)


def write_tokenizer_and_generation(directory: Path, settings: dict[str, Any], tokenizer: Any) -> None:
    """The tokenizer (when there is one) with the trained template as its chat template, and a
    ``generation_config.json`` whose EOS and pad ids stop transformers' ``generate`` where ``neva.generate`` stops
    (the end of a turn; pad: the tokenizer's, else the first EOS)."""
    import transformers

    eos = pad = None
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
        write_chat_template_files(directory, export_chat_template(settings, tokenizer))
        eos = generation_eos_ids(settings, tokenizer)
        first = eos[0] if isinstance(eos, list) else eos
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else first
    transformers.GenerationConfig(
        bos_token_id=getattr(tokenizer, "bos_token_id", None), eos_token_id=eos, pad_token_id=pad
    ).save_pretrained(str(directory))


def write_chat_template_files(directory: Path, template: str) -> None:
    """Put ``template`` where transformers 4.x and 5.x processors and tokenizers read it."""
    (directory / CHAT_TEMPLATE_JINJA).write_text(template)
    (directory / CHAT_TEMPLATE_JSON).write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
    _update_json(directory / TOKENIZER_CONFIG, lambda data: data.update(chat_template=template))


def make_transformers_4_readable(directory: Path, cfg: NevaConfig, dtype: torch.dtype | None) -> None:
    """Add the 4.x spellings to ``config.json`` and ``tokenizer_config.json`` written by transformers 5."""

    def config(data: dict[str, Any]) -> None:
        if dtype is not None:
            data["torch_dtype"] = str(dtype).removeprefix("torch.")
        text = data["text_config"]
        text["rope_theta"] = cfg.llm.rope_theta
        text["rope_scaling"] = dict(cfg.llm.rope_scaling) if cfg.llm.rope_scaling else None

    _update_json(directory / "config.json", config)
    make_tokenizer_4_readable(directory)
    # 4.x passes every processor_config.json entry to LlavaProcessor(...), the nested image processor included ("got
    # multiple values for argument 'image_processor'"); 5.x reads it from preprocessor_config.json as well.
    if (directory / PROCESSOR_CONFIG).is_file() and (directory / "preprocessor_config.json").is_file():
        _update_json(directory / PROCESSOR_CONFIG, lambda data: data.pop("image_processor", None))


def make_tokenizer_4_readable(directory: Path) -> None:
    """Add the 4.x spellings to a ``tokenizer_config.json`` written by transformers 5 (none: nothing to do)."""

    def tokenizer(data: dict[str, Any]) -> None:
        cls = data.get("tokenizer_class")
        data["tokenizer_class"] = _TOKENIZER_CLASS_4X.get(cls, cls)
        # PreTrainedTokenizerFast also returns token_type_ids, which 4.x's generate() refuses for Llava
        data.setdefault("model_input_names", ["input_ids", "attention_mask"])
        # 5.x lists extra special tokens; 4.47+ expects a dict there ("'list' object has no attribute 'keys'").
        # Both read the list under its 4.x name.
        extra = data.get("extra_special_tokens")
        if isinstance(extra, list):
            del data["extra_special_tokens"]
            known = data.get("additional_special_tokens") or []
            data["additional_special_tokens"] = known + [t for t in extra if t not in known]

    if (directory / TOKENIZER_CONFIG).is_file():
        _update_json(directory / TOKENIZER_CONFIG, tokenizer)


def _update_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
