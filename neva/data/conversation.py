"""Conversation templates: LLaVA-format turns → prompt text plus the character spans that are learned.

A template renders a conversation exactly as LLaVA's ``Conversation.get_prompt`` (or the tokenizer's chat template)
does and records, piece by piece, which characters are an assistant reply or the end-of-turn text right after it.
Masking then happens on token offsets (``neva.data.encoding``), never by counting tokens per turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.errors import SampleError

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
_ROLE_NAMES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "system": SYSTEM}

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
LLAMA_2_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the user "
    "provides, and assist the user with a variety of tasks using natural language."
)


class ConversationError(SampleError):
    """A record whose conversation cannot be rendered."""


@dataclass(frozen=True)
class Message:
    """One turn: ``role`` is ``user``, ``assistant`` or ``system``."""

    role: str
    content: str


@dataclass(frozen=True)
class Rendered:
    """Prompt text, its learned character spans ``[start, end)`` and how the tokenizer must be called."""

    text: str
    learned_spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool = True


def parse_conversations(conversations: Any) -> list[Message]:
    """LLaVA ``conversations`` (``from``/``value``) → messages, validated (``read_conversation`` without the flag)."""
    return read_conversation(conversations)[0]


def read_conversation(conversations: Any) -> tuple[list[Message], bool]:
    """LLaVA ``conversations`` (``from``/``value``) → ``(messages, dropped)``, validated.

    Accepts ``human``/``user``, ``gpt``/``assistant`` and ``system`` roles (also ``role``/``content`` keys). An
    optional system turn may lead; then turns alternate user, assistant, starting with the user. A leading assistant
    turn is dropped (``dropped`` is True), as LLaVA's ``preprocess`` and NeMo do (``if roles[source[0]["from"]] !=
    conv.roles[0]: source = source[1:]``): the sample is kept, the caller counts the drop.

    Raises:
        ConversationError: ``empty_conversation``, ``unknown_role`` or ``bad_turn_order``.
    """
    if not isinstance(conversations, list) or not conversations:
        raise ConversationError("empty_conversation", "no conversations")
    messages = []
    for turn in conversations:
        if not isinstance(turn, dict):
            raise ConversationError("malformed_record", f"turn is not an object: {turn!r:.80}")
        role = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if not isinstance(role, str) or role.lower() not in _ROLE_NAMES:
            raise ConversationError("unknown_role", f"role {role!r}")
        if not isinstance(value, str):
            raise ConversationError("malformed_record", f"turn value is not a string: {value!r:.80}")
        messages.append(Message(_ROLE_NAMES[role.lower()], value))
    lead = 1 if messages[0].role == SYSTEM else 0
    dropped = len(messages) > lead and messages[lead].role == ASSISTANT
    if dropped:
        messages = messages[:lead] + messages[lead + 1 :]
    body = messages[lead:]
    if not body or not any(m.role == ASSISTANT for m in body):
        raise ConversationError("empty_conversation", "no assistant turn")
    for i, message in enumerate(body):
        expected = USER if i % 2 == 0 else ASSISTANT
        if message.role != expected:
            raise ConversationError("bad_turn_order", f"turn {i} is {message.role}, expected {expected}")
    return messages, dropped


def count_image_tags(messages: list[Message]) -> int:
    """Number of ``<image>`` tags in all turns."""
    return sum(m.content.count(IMAGE_TOKEN) for m in messages)


def place_image_tags(messages: list[Message], placement: str) -> list[Message]:
    """Apply ``image_token_placement``: ``front`` does what LLaVA's ``preprocess_multimodal`` does.

    LLaVA strips the tag out of the turn and puts ``<image>\\n`` in front of it (then strips the result); with k tags
    in one turn we put k of them in front so that the tag count still equals the image count.
    """
    if placement == "inline":
        return messages
    out = []
    for m in messages:
        k = m.content.count(IMAGE_TOKEN)
        if k and m.role == USER:
            rest = m.content.replace(IMAGE_TOKEN, "").strip()
            m = Message(m.role, ((IMAGE_TOKEN + "\n") * k + rest).strip())
        out.append(m)
    return out


class Template:
    """Base of the documented formats: subclasses yield ``(text, learned)`` pieces."""

    name = ""
    default_system: str | None = None
    eot = ""  # end-of-turn text learned after each reply (documentation and chat-template rendering)
    assistant_cue = ""  # what opens an assistant turn after the last user turn (the prompt ends with it)

    def pieces(self, messages: list[Message], system: str | None) -> list[tuple[str, bool]]:
        raise NotImplementedError

    def generation_prefix(self, messages: list[Message], system: str | None) -> str:
        """Prompt text for inference: the conversation so far (ending with a user turn) plus the assistant cue."""
        return "".join(p for p, _ in self.pieces(messages, system)) + self.assistant_cue

    def render(self, messages: list[Message], system_prompt: str | None = None) -> Rendered:
        """Render a whole conversation (a leading system message overrides the system prompt)."""
        system, body = _split_system(messages, system_prompt, self.default_system)
        text, spans, pos = [], [], 0
        for piece, learned in self.pieces(body, system):
            if learned and piece:
                spans.append((pos, pos + len(piece)))
            text.append(piece)
            pos += len(piece)
        return Rendered("".join(text), _merge(spans))

    def render_prompt(self, messages: list[Message], system_prompt: str | None = None) -> str:
        """The text a model is given at inference, ending where the assistant's reply starts."""
        system, body = _split_system(messages, system_prompt, self.default_system)
        return self.generation_prefix(body, system)


class PlainTemplate(Template):
    """LLaVA ``plain`` (pretraining): ``<image>`` × n + caption + ``\\n``; the human text is dropped (LLaVA does)."""

    name = "plain"
    eot = "\n"

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
    """Mistral instruct: ``[INST] {q} [/INST]{a}</s>``; a system prompt leads the first user turn."""

    name = "mistral"
    eot = "</s>"

    def pieces(self, messages, system):
        out = []
        for i, m in enumerate(messages):
            if m.role == USER:
                content = f"{system}\n\n{m.content}" if i == 0 and system else m.content
                out.append((f"[INST] {content} [/INST]", False))
            else:
                out += [(m.content, True), ("</s>", True)]
        return out


class Llama3Template(Template):
    """Llama-3 instruct headers; BOS (``<|begin_of_text|>``) comes from the tokenizer."""

    name = "llama_3"
    eot = "<|eot_id|>"
    assistant_cue = "<|start_header_id|>assistant<|end_header_id|>\n\n"

    @staticmethod
    def _header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    def pieces(self, messages, system):
        out = [(self._header(SYSTEM) + system + "<|eot_id|>", False)] if system else []
        for m in messages:
            if m.role == USER:
                out.append((self._header(USER) + m.content + "<|eot_id|>", False))
            else:
                out += [(self._header(ASSISTANT), False), (m.content, True), ("<|eot_id|>", True)]
        return out


class ChatMLTemplate(Template):
    """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""

    name = "chatml"
    eot = "<|im_end|>"
    assistant_cue = "<|im_start|>assistant\n"

    def pieces(self, messages, system):
        out = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)] if system else []
        for m in messages:
            if m.role == USER:
                out.append((f"<|im_start|>user\n{m.content}<|im_end|>\n", False))
            else:
                out += [("<|im_start|>assistant\n", False), (m.content, True), ("<|im_end|>", True), ("\n", False)]
        return out


class ChatTemplateRenderer(Template):
    """Renders with a tokenizer's own Jinja chat template and recovers the reply spans exactly.

    Each assistant reply is first replaced by a unique sentinel; the sentinel text is rendered and the sentinels are
    swapped back for the replies. The result must equal the real rendering character for character (otherwise the
    template transforms replies in a way we cannot map, and the sample is refused rather than mislabelled). The
    template's end-of-turn text (``eot``) right after a reply is learned too. Chat templates put BOS in the text, so the
    tokenizer is called without special tokens (as ``apply_chat_template`` does).
    """

    def __init__(self, tokenizer: Any, base: Template) -> None:
        self.tokenizer = tokenizer
        self.name = base.name
        self.eot = base.eot

    def _apply(self, messages: list[Message], generation: bool = False) -> str:
        msgs = [{"role": m.role, "content": m.content} for m in messages]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)

    def render(self, messages: list[Message], system_prompt: str | None = None) -> Rendered:
        if system_prompt is not None and messages[0].role != SYSTEM:
            messages = [Message(SYSTEM, system_prompt), *messages]
        real = self._apply(messages)
        replies = [m.content for m in messages if m.role == ASSISTANT]
        sentinels = [f"\x00R{i}\x00" for i in range(len(replies))]
        it = iter(sentinels)
        masked = self._apply([Message(m.role, next(it)) if m.role == ASSISTANT else m for m in messages])
        for variant in (replies, [r.strip() for r in replies]):
            text, spans, pos = [], [], 0
            rest = masked
            for sentinel, reply in zip(sentinels, variant):
                head, sep, rest = rest.partition(sentinel)
                if not sep:
                    break
                text.append(head + reply)
                pos += len(head)
                end = pos + len(reply)
                if self.eot and rest.startswith(self.eot):
                    end += len(self.eot)
                spans.append((pos, end))
                pos += len(reply)
            else:
                text.append(rest)
                if "".join(text) == real:
                    return Rendered(real, _merge(spans), add_special_tokens=False)
        raise ConversationError("template_error", f"{self.name} chat template changes replies; cannot locate them")

    def render_prompt(self, messages: list[Message], system_prompt: str | None = None) -> str:
        if system_prompt is not None and messages[0].role != SYSTEM:
            messages = [Message(SYSTEM, system_prompt), *messages]
        return self._apply(messages, generation=True)


TEMPLATE_CLASSES: dict[str, type[Template]] = {
    t.name: t
    for t in (PlainTemplate, VicunaV1Template, Llama2Template, MistralTemplate, Llama3Template, ChatMLTemplate)
}


def get_template(name: str, tokenizer: Any = None, use_chat_template: bool = True) -> Template:
    """The template called ``name``; ``mistral``/``llama_3``/``chatml`` use the tokenizer's chat template if it has one.

    Raises:
        ValueError: unknown template name.
    """
    if name not in TEMPLATE_CLASSES:
        raise ValueError(f"unknown conversation template {name!r}; choose one of {sorted(TEMPLATE_CLASSES)}")
    base = TEMPLATE_CLASSES[name]()
    if (
        use_chat_template
        and name in ("mistral", "llama_3", "chatml")
        and tokenizer is not None
        and getattr(tokenizer, "chat_template", None)
    ):
        return ChatTemplateRenderer(tokenizer, base)
    return base


def _split_system(
    messages: list[Message], override: str | None, default: str | None
) -> tuple[str | None, list[Message]]:
    if messages and messages[0].role == SYSTEM:
        return messages[0].content, messages[1:]
    return (override if override is not None else default), messages


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)
