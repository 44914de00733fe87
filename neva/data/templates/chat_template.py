"""Rendering with a tokenizer's own Jinja chat template (``model.data.use_chat_template``), the reply spans recovered
exactly."""

from __future__ import annotations

import warnings
from typing import Any

from neva.data.templates.base import (
    ASSISTANT,
    SYSTEM,
    USER,
    ConversationError,
    Message,
    Rendered,
    Template,
    merge_spans,
)


class ChatTemplateRenderer(Template):
    """Renders with a tokenizer's own Jinja chat template and recovers the reply spans exactly.

    Each assistant reply is first replaced by a unique sentinel; the sentinel text is rendered and the sentinels are
    swapped back for the replies. The result must equal the real rendering character for character (otherwise the
    template transforms replies in a way we cannot map, and the sample is refused rather than mislabelled). The
    template's end-of-turn text (``eot``) right after a reply is learned too. Chat templates put BOS in the text, so the
    tokenizer is called without special tokens (as ``apply_chat_template`` does).

    Two template habits are handled so that what is trained is what is served:

    - a template that puts the system prompt on the *last* user turn (Mistral v0.3) renders no system prompt at all
      for a conversation that ends with a reply; such a conversation is rendered as the served prompt of its final
      reply (system prompt included) followed by that reply;
    - a template that raises (the original Mistral template refuses any system turn) becomes a ``template_error``
      sample error, which the data pipeline counts as a skip.
    """

    def __init__(self, tokenizer: Any, base: Template) -> None:
        self.tokenizer = tokenizer
        self.name = base.name
        self.eot = base.eot
        self.warn_if_final_eot_missing()

    def _apply(self, messages: list[Message], generation: bool = False) -> str:
        from jinja2 import TemplateError

        msgs = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)
        except TemplateError as exc:
            raise ConversationError("template_error", f"{self.name} chat template: {exc}") from exc

    def _compose(self, messages: list[Message]) -> str:
        """The training text of ``messages``: the template's rendering, unless that drops a given system prompt."""
        full = self._apply(messages)
        system = messages[0].content if messages[0].role == SYSTEM else ""
        if not system.strip() or messages[-1].role != ASSISTANT or full != self._apply(messages[1:]):
            return full  # no system prompt, or the template renders it
        # The template shows the system prompt only with the last user turn (as served): train the final reply in
        # exactly its served context; the tail (reply, end of turn) is what the template writes after that prompt.
        body = messages[1:]
        served = self._apply(messages[:-1], generation=True)
        prompt, whole = self._apply(body[:-1], generation=True), self._apply(body)
        if not whole.startswith(prompt) or system not in served:
            raise ConversationError("template_error", f"{self.name} chat template drops the system prompt")
        return served + whole[len(prompt) :]

    def render(self, messages: list[Message], system_prompt: str | None = None) -> Rendered:
        if system_prompt is not None and messages[0].role != SYSTEM:
            messages = [Message(SYSTEM, system_prompt), *messages]
        real = self._compose(messages)
        replies = [m.content for m in messages if m.role == ASSISTANT]
        sentinels = [f"\x00R{i}\x00" for i in range(len(replies))]
        it = iter(sentinels)
        masked = self._compose([Message(m.role, next(it)) if m.role == ASSISTANT else m for m in messages])
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
                    return Rendered(real, merge_spans(spans), add_special_tokens=False)
        raise ConversationError("template_error", f"{self.name} chat template changes replies; cannot locate them")

    def render_prompt(self, messages: list[Message], system_prompt: str | None = None) -> str:
        if system_prompt is not None and messages[0].role != SYSTEM:
            messages = [Message(SYSTEM, system_prompt), *messages]
        return self._apply(messages, generation=True)

    def final_eot_emitted(self) -> bool:
        """Whether the template writes ``eot`` right after the final reply (else the model never learns to stop)."""
        text = self._apply([Message(USER, "Hi"), Message(ASSISTANT, "\x00E\x00")])
        return text.partition("\x00E\x00")[2].startswith(self.eot)

    def warn_if_final_eot_missing(self) -> None:
        """Warn (once per template) when the final reply is not followed by the end-of-turn text."""
        try:
            emitted = self.final_eot_emitted()
        except ConversationError:
            return  # a template that cannot render a one-turn conversation fails on every sample, with its reason
        if not emitted:
            warnings.warn(
                f"the tokenizer's chat template ({self.name}) does not write {self.eot!r} after the final reply: "
                "the last reply of every sample is trained without an end of turn, so the model does not learn to "
                f"stop; fix the template (e.g. emit {self.eot!r} after every assistant turn) or set "
                "model.data.use_chat_template=false to use neva's built-in format",
                stacklevel=3,
            )

    def check_system_prompt(self, system_prompt: str) -> None:
        """Refuse at start a system prompt the template raises on or never renders.

        Raises:
            ValueError: naming ``model.data.system_prompt`` and what to do instead.
        """
        probe = [Message(SYSTEM, system_prompt), Message(USER, "Hi"), Message(ASSISTANT, "Hello")]
        try:
            text = self._compose(probe)
        except ConversationError as exc:
            detail = exc.detail
        else:
            if system_prompt in text:
                return
            detail = "the rendering does not contain it"
        raise ValueError(
            f"model.data.system_prompt is set but the tokenizer's {self.name} chat template cannot render a system "
            f"prompt ({detail}); drop model.data.system_prompt or set model.data.use_chat_template=false to use "
            f"neva's built-in {self.name} format (which puts the system prompt in the first user turn)"
        )
