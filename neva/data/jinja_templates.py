"""The Jinja chat template an export ships: it renders what neva trained on, for ``apply_chat_template`` users.

One Jinja body per built-in template (``conversation.py``) reproduces its rendering character for character (tests
compare both on the same conversations); a run that rendered with the tokenizer's own chat template exports that
template. A prelude makes either accept what HF processors pass: content as a list of ``{"type": "image"}`` /
``{"type": "text", "text": ...}`` parts becomes one string with ``<image>\\n`` per image in front of the text, as
``image_token_placement=front`` (LLaVA) does in training. The run's system prompt (``model.data.system_prompt``, else
the template's default) is the exported default, so what is served without a system message is what was trained.

Like llava-hf's own templates, the built-in bodies do not write BOS: the tokenizer adds it (``LlavaProcessor`` calls
it with special tokens), which is how neva tokenizes its built-in renderings.
"""

from __future__ import annotations

import json
from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.conversation import QWEN_IMAGE_BLOCK, ChatTemplateRenderer, Glm4vTemplate, get_template

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
# Built-in bodies: ``system`` is the leading system message, else the default; ``messages`` the turns after it.
_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = DEFAULT_SYSTEM -%}{%- endif -%}"
)
BODIES = {
    "plain": (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- IMAGE_TOKEN * m['content'].count(IMAGE_TOKEN) -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- m['content'] + '\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    "vicuna_v1": (
        "{{- (system or '') + ' ' -}}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + ' ' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + m['content'] + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    ),
    "llama_2": (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- if loop.index0 == 0 and system -%}"
        "{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content'] -%}"
        "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
        "{{- ('<s>' if loop.index0 else '') + '[INST] ' + content + ' [/INST]' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + ' </s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    "mistral": (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- if loop.index0 == 0 and system -%}{%- set content = system + '\\n\\n' + m['content'] -%}"
        "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
        "{{- ' [INST] ' + content + ' [/INST]' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    "llama_3": (
        "{%- if system -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system | trim + '<|eot_id|>' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
    "chatml": (
        "{%- if system -%}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
}
# Qwen-VL's ChatML: each <image> tag is Qwen's vision block (conversation.QwenVLTemplate); qwen3_vl differs in its
# default system prompt only.
BODIES["qwen2_vl"] = BODIES["qwen3_vl"] = (
    "{%- if system -%}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] | replace(IMAGE_TOKEN, "
    + json.dumps(QWEN_IMAGE_BLOCK)
    + ")) + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# GLM-4.1V's (conversation.Glm4vTemplate): each <image> tag its image block, the EOS learned after each reply.
BODIES["glm4v"] = (
    "{{- '[gMASK]<sop>' -}}{%- if system -%}{{- '<|system|>\\n' + system -}}{%- endif -%}"
    "{%- for m in messages -%}{%- set content = m['content'] | replace(IMAGE_TOKEN, "
    + json.dumps(Glm4vTemplate.image_block)
    + ") -%}"
    "{%- if m['role'] == 'user' -%}{{- '<|user|>\\n' + content -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<|assistant|>\\n' + content + '<|endoftext|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
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
    default = system_prompt if system_prompt is not None else template.default_system
    return header + "{%- set DEFAULT_SYSTEM = " + _literal(default) + " -%}" + _SYSTEM + BODIES[name]
