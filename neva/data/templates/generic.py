"""The generic conversation formats (LLaVA's and the common chat formats), each with the Jinja body an export ships.

Each body renders exactly as its class's ``pieces`` (tests compare both on the same conversations); in it ``system`` is
the leading system message, else the default, and ``messages`` the turns after it (``neva.data.jinja_templates``).
"""

from __future__ import annotations

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import ASSISTANT, SYSTEM, USER, ConversationError, Template

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
LLAMA_2_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the user "
    "provides, and assist the user with a variety of tasks using natural language."
)


class PlainTemplate(Template):
    """LLaVA ``plain`` (pretraining): ``<image>`` × n + caption + ``\\n``; the human text is dropped (LLaVA does)."""

    name = "plain"
    eot = "\n"
    jinja_body = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- IMAGE_TOKEN * m['content'].count(IMAGE_TOKEN) -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- m['content'] + '\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
    )

    def pieces(self, messages, system):
        if len(messages) != 2:
            raise ConversationError(
                "bad_turn_order", f"plain template needs one user and one assistant turn, got {len(messages)}"
            )
        tags = IMAGE_TOKEN * messages[0].content.count(IMAGE_TOKEN)
        return [(tags, False), (messages[1].content, True), ("\n", True)]

    def generation_prefix(self, messages, system):
        return IMAGE_TOKEN * messages[0].content.count(IMAGE_TOKEN)


class VicunaV1Template(Template):
    """LLaVA ``v1`` (``conv_vicuna_v1``): ``{system} USER: {q} ASSISTANT: {a}</s>``."""

    name = "vicuna_v1"
    default_system = VICUNA_SYSTEM
    eot = "</s>"
    assistant_cue = "ASSISTANT:"
    jinja_body = (
        "{{- (system or '') + ' ' -}}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + ' ' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + m['content'] + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    )

    def pieces(self, messages, system):
        out = [((system or "") + " ", False)]
        for m in messages:
            if m.role == USER:
                out.append((f"USER: {m.content} ", False))
            else:
                out += [("ASSISTANT: ", False), (m.content, True), ("</s>", True)]
        return out


class Llama2Template(Template):
    """LLaVA ``llava_llama_2``: ``[INST] <<SYS>>\\n{s}\\n<</SYS>>\\n\\n{q} [/INST] {a} </s><s>[INST] ...``.

    The leading ``<s>`` is the tokenizer's BOS (LLaVA strips it from the text with ``lstrip(sep)``).
    """

    name = "llama_2"
    default_system = LLAMA_2_SYSTEM
    eot = " </s>"
    jinja_body = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- if loop.index0 == 0 and system -%}"
        "{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content'] -%}"
        "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
        "{{- ('<s>' if loop.index0 else '') + '[INST] ' + content + ' [/INST]' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + ' </s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    )

    def pieces(self, messages, system):
        out = []
        for i, m in enumerate(messages):
            if m.role == USER:
                content = m.content
                if i == 0 and system:
                    content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
                out.append(((("<s>" if i else "") + f"[INST] {content} [/INST]"), False))
            else:
                out += [(" ", False), (m.content, True), (" </s>", True)]
        return out


class MistralTemplate(Template):
    """Mistral instruct as its official HF template (v0.1/v0.2): `` [INST] {q} [/INST] {a}</s> [INST] ...``.

    A system prompt leads the first user turn. BOS comes from the tokenizer. The reply follows ``[/INST]`` after a
    space, so its first token is the word-initial one (``▁Red``), as Mistral's own tokenization has it. Mistral v0.3's
    official template differs (``[/INST]`` without a space before it, the system prompt on the last user turn): with a
    v0.3 tokenizer, ``use_chat_template`` renders with that template (see ``ChatTemplateRenderer``).
    """

    name = "mistral"
    eot = "</s>"
    jinja_body = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- if loop.index0 == 0 and system -%}{%- set content = system + '\\n\\n' + m['content'] -%}"
        "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
        "{{- ' [INST] ' + content + ' [/INST]' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    )

    def pieces(self, messages, system):
        out = []
        for i, m in enumerate(messages):
            if m.role == USER:
                content = f"{system}\n\n{m.content}" if i == 0 and system else m.content
                out.append((f" [INST] {content} [/INST]", False))
            else:
                out += [(" ", False), (m.content, True), ("</s>", True)]
        return out


class Llama3Template(Template):
    """Llama-3 instruct headers as Meta's template renders them: every content trimmed; BOS comes from the tokenizer."""

    name = "llama_3"
    eot = "<|eot_id|>"
    assistant_cue = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    jinja_body = (
        "{%- if system -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system | trim + '<|eot_id|>' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    )

    @staticmethod
    def _header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    def pieces(self, messages, system):
        out = [(self._header(SYSTEM) + system.strip() + "<|eot_id|>", False)] if system else []
        for m in messages:
            if m.role == USER:
                out.append((self._header(USER) + m.content.strip() + "<|eot_id|>", False))
            else:
                out += [(self._header(ASSISTANT), False), (m.content.strip(), True), ("<|eot_id|>", True)]
        return out


class ChatMLTemplate(Template):
    """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""

    name = "chatml"
    eot = "<|im_end|>"
    assistant_cue = "<|im_start|>assistant\n"
    jinja_body = (
        "{%- if system -%}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )

    def pieces(self, messages, system):
        out = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)] if system else []
        for m in messages:
            if m.role == USER:
                out.append((f"<|im_start|>user\n{m.content}<|im_end|>\n", False))
            else:
                out += [("<|im_start|>assistant\n", False), (m.content, True), ("<|im_end|>", True), ("\n", False)]
        return out


GENERIC: tuple[type[Template], ...] = (
    PlainTemplate,
    VicunaV1Template,
    Llama2Template,
    MistralTemplate,
    Llama3Template,
    ChatMLTemplate,
)
"""The formats every family may use, in the order their names are listed."""
