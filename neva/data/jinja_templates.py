"""The Jinja chat template an export ships: it renders what neva trained on, for ``apply_chat_template`` users.

Each built-in template carries the Jinja body that reproduces its rendering character for character (its
``jinja_body``, beside its ``pieces`` in ``neva.data.templates``; tests compare both on the same conversations); a
run that rendered with the tokenizer's own chat template exports that template. A prelude makes either accept what
HF processors pass: content as a list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts becomes one
string with ``<image>\\n`` per image in front of the text, as ``image_token_placement=front`` (LLaVA) does in
training. The run's system prompt (``model.data.system_prompt``, else the template's default) is the exported
default, so what is served without a system message is what was trained.

Like llava-hf's own templates, the built-in bodies do not write BOS: the tokenizer adds it (``LlavaProcessor`` calls
it with special tokens), which is how neva tokenizes its built-in renderings.
"""

from __future__ import annotations

import json
from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.templates.chat_template import ChatTemplateRenderer
from neva.data.templates.registry import get_template

# Content parts → one string per message (images first, then text), as LLaVA's front placement leaves a turn.
_PRELUDE = (
    "{%- set ns = namespace(msgs=[], img='', txt='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['content'] is string -%}"
    "{%- set ns.msgs = ns.msgs + [{'role': m['role'], 'content': m['content']}] -%}"
    "{%- else -%}"
    "{%- set ns.img = '' -%}{%- set ns.txt = '' -%}"
    "{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'image' -%}{%- set ns.img = ns.img + IMAGE_LINE -%}"
    "{%- elif part['type'] == 'text' -%}{%- set ns.txt = ns.txt + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.img -%}{%- set ns.txt = (ns.img + (ns.txt | trim)) | trim -%}{%- endif -%}"
    "{%- set ns.msgs = ns.msgs + [{'role': m['role'], 'content': ns.txt}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = ns.msgs -%}"
)
# Built-in bodies (each template's ``jinja_body``): ``system`` is the leading system message, else the default;
# ``messages`` the turns after it.
_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = DEFAULT_SYSTEM -%}{%- endif -%}"
)


def _literal(value: str | None) -> str:
    # JSON escapes are Jinja string escapes too; ensure_ascii keeps the template plain ASCII.
    return "none" if value is None else json.dumps(value, ensure_ascii=True)


def chat_template_for(
    name: str, tokenizer: Any = None, use_chat_template: bool = True, system_prompt: str | None = None
) -> str:
    """The Jinja chat template that renders as a run with these data settings trained.

    Args:
        name: the run's ``conv_template``.
        tokenizer: the run's tokenizer (its own chat template is exported when training rendered with it).
        use_chat_template: the run's ``model.data.use_chat_template``.
        system_prompt: the run's ``model.data.system_prompt`` (None: the template's default).
    """
    template = get_template(name, tokenizer, use_chat_template)
    header = (
        "{#- written by neva: renders as neva trained (template "
        + name
        + ") -#}"
        + "{%- set IMAGE_TOKEN = "
        + _literal(IMAGE_TOKEN)
        + " -%}{%- set IMAGE_LINE = "
        + _literal(IMAGE_TOKEN + "\n")
        + " -%}"
        + _PRELUDE
    )
    if isinstance(template, ChatTemplateRenderer):
        own = tokenizer.chat_template
        if not isinstance(own, str):
            raise ValueError(f"the tokenizer's chat template is not one Jinja string ({type(own).__name__})")
        if system_prompt is None:
            return header + own
        inject = (
            "{%- if not messages or messages[0]['role'] != 'system' -%}"
            "{%- set messages = [{'role': 'system', 'content': " + _literal(system_prompt) + "}] + messages -%}"
            "{%- endif -%}"
        )
        return header + inject + own
    if template.jinja_body is None:
        raise ValueError(
            f"conversation template {name!r} has no Jinja body of neva's (its family's interop writes one)"
        )
    default = system_prompt if system_prompt is not None else template.default_system
    return header + "{%- set DEFAULT_SYSTEM = " + _literal(default) + " -%}" + _SYSTEM + template.jinja_body
