"""What every conversation template is: messages in, prompt text and learned character spans out.

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


class Template:
    """Base of the documented formats: subclasses yield ``(text, learned)`` pieces."""

    name = ""
    default_system: str | None = None
    eot = ""  # end-of-turn text learned after each reply (documentation and chat-template rendering)
    assistant_cue = ""  # what opens an assistant turn after the last user turn (the prompt ends with it)
    image_block = IMAGE_TOKEN  # what an <image> tag is in the rendered text (its image token expanded by encoding)
    # The token in ``image_block`` that stands for the image's positions (what the tokenizer must hold as one token,
    # the model's ``image_token_id``). By template, not by what a tokenizer holds: Qwen2.5's text tokenizers carry
    # <|image_pad|> too, and LLaVA-OneVision trains them with <image>.
    image_token = IMAGE_TOKEN
    # What a served prompt's ``<video>`` tag is written as and the token in it that stands for the video's positions
    # (``neva.inference.PromptBuilder``); None: the model's video token itself.
    video_block: str | None = None
    video_token: str | None = None
    # Whether a raw prompt (``neva.generate --raw``) writes images and videos as these blocks and may hold them as
    # they are, their tokens counted (the family's HF processor's rule: Qwen-VL's); False: LLaVA's ``<image>`` tags.
    raw_blocks = False
    # The Jinja body an export ships (``neva.data.jinja_templates``), rendering exactly as ``pieces`` does; None: neva
    # writes none (the family's interop ships its HF processor's own).
    jinja_body: str | None = None

    def pieces(self, messages: list[Message], system: str | None) -> list[tuple[str, bool]]:
        raise NotImplementedError

    def generation_prefix(self, messages: list[Message], system: str | None) -> str:
        """Prompt text for inference: the conversation so far (ending with a user turn) plus the assistant cue."""
        return "".join(p for p, _ in self.pieces(messages, system)) + self.assistant_cue

    def render(self, messages: list[Message], system_prompt: str | None = None) -> Rendered:
        """Render a whole conversation (a leading system message overrides the system prompt)."""
        system, body = split_system(messages, system_prompt, self.default_system)
        text, spans, pos = [], [], 0
        for piece, learned in self.pieces(body, system):
            if learned and piece:
                spans.append((pos, pos + len(piece)))
            text.append(piece)
            pos += len(piece)
        return Rendered("".join(text), merge_spans(spans))

    def render_prompt(self, messages: list[Message], system_prompt: str | None = None) -> str:
        """The text a model is given at inference, ending where the assistant's reply starts."""
        system, body = split_system(messages, system_prompt, self.default_system)
        return self.generation_prefix(body, system)


def stop_strings(template: Template | None) -> tuple[str, ...]:
    """The template's end-of-turn text as a stop string (e.g. ``<|im_end|>``, plain's newline); none in raw mode."""
    eot = template.eot if template is not None else ""
    return (eot.strip() or eot,) if eot else ()


def end_of_turn_ids(template: Template | None, tokenizer: Any) -> tuple[int, ...]:
    """EOS, plus the end-of-turn token when the template's end-of-turn text is one token (generation stops there)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    for stop in stop_strings(template):
        tok = vocab.get(stop)
        if tok is not None and tok not in ids:
            ids.append(tok)
    return tuple(ids)


def split_system(
    messages: list[Message], override: str | None, default: str | None
) -> tuple[str | None, list[Message]]:
    """The system prompt (a leading system message, else ``override``, else ``default``) and the turns after it."""
    if messages and messages[0].role == SYSTEM:
        return messages[0].content, messages[1:]
    return (override if override is not None else default), messages


def merge_spans(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Touching or overlapping ``[start, end)`` spans joined."""
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)
