"""Conversation templates: LLaVA-format turns → prompt text plus the character spans that are learned.

A template renders a conversation exactly as LLaVA's ``Conversation.get_prompt`` (or the tokenizer's chat template)
does and records, piece by piece, which characters are an assistant reply or the end-of-turn text right after it.
Masking then happens on token offsets (``neva.data.encoding``), never by counting tokens per turn.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.errors import SampleError
from neva.data.tokens import GLM4V_IMAGE, INTERNVL_IMAGE_CONTEXT, PIXTRAL_IMAGE, QWEN_IMAGE_PAD, image_token_for
from neva.typed import ConfigError

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
DEFAULT_TEMPLATE = "vicuna_v1"
"""The prompt format when neither the caller nor the checkpoint's ``conv_template`` metadata names one."""
_ROLE_NAMES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "system": SYSTEM}

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
QWEN_IMAGE_BLOCK = f"<|vision_start|>{QWEN_IMAGE_PAD}<|vision_end|>"
QWEN_VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
"""What an image tag is in Qwen-VL's text: its ``<|image_pad|>`` is the model's image token."""
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
    image_block = IMAGE_TOKEN  # what an <image> tag is in the rendered text (its image token expanded by encoding)

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
    """Mistral instruct as its official HF template (v0.1/v0.2): `` [INST] {q} [/INST] {a}</s> [INST] ...``.

    A system prompt leads the first user turn. BOS comes from the tokenizer. The reply follows ``[/INST]`` after a
    space, so its first token is the word-initial one (``▁Red``), as Mistral's own tokenization has it. Mistral v0.3's
    official template differs (``[/INST]`` without a space before it, the system prompt on the last user turn): with a
    v0.3 tokenizer, ``use_chat_template`` renders with that template (see ``ChatTemplateRenderer``).
    """

    name = "mistral"
    eot = "</s>"

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

    def pieces(self, messages, system):
        out = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)] if system else []
        for m in messages:
            if m.role == USER:
                out.append((f"<|im_start|>user\n{m.content}<|im_end|>\n", False))
            else:
                out += [("<|im_start|>assistant\n", False), (m.content, True), ("<|im_end|>", True), ("\n", False)]
        return out


class QwenVLTemplate(ChatMLTemplate):
    """Qwen2-VL / Qwen2.5-VL's ChatML, as their chat template renders a conversation of strings (a system turn
    "You are a helpful assistant." when none is given) and as Qwen's ``qwen-vl-finetune`` trainer turns LLaVA-format
    records into it: each ``<image>`` tag becomes ``<|vision_start|><|image_pad|><|vision_end|>`` in place, the
    ``<|image_pad|>`` then expanded to the image's positions like any image token (``neva.data.encoding``)."""

    name = "qwen2_vl"
    default_system = "You are a helpful assistant."
    image_block = QWEN_IMAGE_BLOCK
    # What a served prompt's ``<video>`` tag is written as (``neva.inference.PromptBuilder``); training's video tags
    # reach the template as ``<image>`` tags and get their video token after encoding (``neva.data.front_ends``).
    video_block = QWEN_VIDEO_BLOCK

    def pieces(self, messages, system):
        # The newline after a reply's <|im_end|> is learned too: qwen-vl-finetune labels `ans_start : ans_end + 2`,
        # the reply, <|im_end|> and the token after it (QwenLM/Qwen2.5-VL qwen-vl-finetune/qwenvl/data/
        # data_processor.py, preprocess_qwen_visual; its earlier preprocess_qwen_2_visual learned each assistant
        # turn's chat-template encoding, `<|im_end|>\n` included, but its first three tokens). ChatML's LLaVA-style
        # trainers (chatml) learn up to <|im_end|> only.
        out, after_reply = [], False
        for text, learned in super().pieces(messages, system):
            out.append((text.replace(IMAGE_TOKEN, QWEN_IMAGE_BLOCK), learned or (after_reply and text == "\n")))
            after_reply = learned and text == self.eot
        return out


class Qwen3VLTemplate(QwenVLTemplate):
    """Qwen3-VL's: the same blocks, no system turn unless one is given (its chat template adds none)."""

    name = "qwen3_vl"
    default_system = None


class InternVLTemplate(ChatMLTemplate):
    """InternVL 3 / 3.5's ChatML, as transformers' InternVL chat template renders a conversation of strings (no
    system turn unless one is given) and as ``InternVLProcessor`` expands it: each ``<image>`` tag becomes
    ``<img><IMG_CONTEXT></img>`` in place, the ``<IMG_CONTEXT>`` then expanded to the image's positions (tiles × 256)
    like any image token (``neva.data.encoding``)."""

    name = "internvl"
    image_block = f"<img>{INTERNVL_IMAGE_CONTEXT}</img>"

    def pieces(self, messages, system):
        return [
            (text.replace(IMAGE_TOKEN, self.image_block), learned) for text, learned in super().pieces(messages, system)
        ]


class Glm4vTemplate(Template):
    """GLM-4.1V's format as LLaMA-Factory's ``glm4v`` template writes it (src/llamafactory/data/template.py:
    prefix ``[gMASK]<sop>``, ``<|system|>\n{s}``, ``<|user|>\n{q}``, ``<|assistant|>\n{a}``, and the tokenizer's EOS
    ``<|endoftext|>`` learned after each reply (``efficient_eos``)), which is also how the hub's chat template renders
    a conversation of strings up to the end of turn. Each ``<image>`` tag becomes
    ``<|begin_of_image|><|image|><|end_of_image|>`` in place, the ``<|image|>`` then expanded to the image's
    positions (``Glm4vProcessor``'s ``image_token``) like any image token (``neva.data.encoding``)."""

    name = "glm4v"
    eot = "<|endoftext|>"
    assistant_cue = "<|assistant|>\n"
    image_block = f"<|begin_of_image|>{GLM4V_IMAGE}<|end_of_image|>"

    def pieces(self, messages, system):
        out = [("[gMASK]<sop>" + (f"<|system|>\n{system}" if system else ""), False)]
        for m in messages:
            content = m.content.replace(IMAGE_TOKEN, self.image_block)
            if m.role == USER:
                out.append((f"<|user|>\n{content}", False))
            else:
                out += [("<|assistant|>\n", False), (content, True), (self.eot, True)]
        return out


class Mistral3Template(Template):
    """Mistral 3's chat format (Mistral Small 3.1's ``chat_template``; mistral-common's Tekken instruct format, no spaces
    around ``[INST]`` / ``[/INST]``): ``[SYSTEM_PROMPT]{s}[/SYSTEM_PROMPT]`` where a system prompt is given,
    ``[INST]{q}[/INST]{a}</s>`` per exchange, BOS from the tokenizer. An ``<image>`` tag is
    ``[IMG]`` in place (the template's image part), which ``PixtralProcessor`` expands to the image's rows of
    ``[IMG]`` with their ``[IMG_BREAK]`` / ``[IMG_END]`` (``neva.data.pixtral_images``)."""

    name = "mistral3"
    eot = "</s>"
    image_block = PIXTRAL_IMAGE

    def pieces(self, messages, system):
        out = [(f"[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]", False)] if system else []
        for m in messages:
            content = m.content.replace(IMAGE_TOKEN, self.image_block)
            if m.role == USER:
                out.append((f"[INST]{content}[/INST]", False))
            else:
                out += [(content, True), ("</s>", True)]
        return out


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
                    return Rendered(real, _merge(spans), add_special_tokens=False)
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


class Gemma3Template(Template):
    """Gemma 3's chat template (google/gemma-3-*-it ``tokenizer_config.json``):
    ``<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n``, a system prompt leading
    the first user turn (``{s}\n\n``), BOS from the tokenizer. A turn with ``<image>`` tags is the template's
    content list (text, image, text, ...): each text part trimmed, each image its ``<start_of_image>``, which
    ``Gemma3Processor`` expands to ``\n\n<start_of_image>`` + the image's tokens + ``<end_of_image>\n\n`` (one
    ``<image_soft_token>`` here, expanded to the image's count like any image token, ``neva.data.encoding``)."""

    name = "gemma3"
    eot = "<end_of_turn>"
    assistant_cue = "<start_of_turn>model\n"
    image_block = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"

    def pieces(self, messages, system):
        out = []
        for i, m in enumerate(messages):
            content = self.image_block.join(part.strip() for part in m.content.split(IMAGE_TOKEN))
            if m.role == USER:
                prefix = f"{system}\n\n" if i == 0 and system else ""
                out.append((f"<start_of_turn>user\n{prefix}{content}<end_of_turn>\n", False))
            else:
                out += [("<start_of_turn>model\n", False), (content, True), ("<end_of_turn>", True), ("\n", False)]
        return out


TEMPLATE_CLASSES: dict[str, type[Template]] = {
    t.name: t
    for t in (
        PlainTemplate,
        VicunaV1Template,
        Llama2Template,
        MistralTemplate,
        Llama3Template,
        ChatMLTemplate,
        QwenVLTemplate,
        Qwen3VLTemplate,
        Gemma3Template,
        InternVLTemplate,
        Glm4vTemplate,
        Mistral3Template,
    )
}


def get_template(
    name: str, tokenizer: Any = None, use_chat_template: bool = True, system_prompt: str | None = None
) -> Template:
    """The template called ``name``; ``mistral``/``llama_3``/``chatml`` use the tokenizer's chat template if it has one.

    ``system_prompt`` (the run's ``model.data.system_prompt``) is checked against a tokenizer's chat template at once,
    so a template that refuses system prompts stops the run at start instead of skipping every sample.

    Raises:
        ConfigError: unknown template name. ValueError: a system prompt the tokenizer's chat template cannot render.
    """
    if name not in TEMPLATE_CLASSES:
        raise ConfigError(f"unknown conversation template {name!r}; choose one of {sorted(TEMPLATE_CLASSES)}")
    base = TEMPLATE_CLASSES[name]()
    if (
        use_chat_template
        and name in ("mistral", "llama_3", "chatml")
        and tokenizer is not None
        and getattr(tokenizer, "chat_template", None)
    ):
        renderer = ChatTemplateRenderer(tokenizer, base)
        if system_prompt is not None:
            renderer.check_system_prompt(system_prompt)
        return renderer
    return base


def raw_image_text(name: str) -> tuple[str, str]:
    """What a raw prompt's ``<image>`` tag becomes for a checkpoint trained with template ``name``: the template's
    image block and the image token text in it, which is repeated to the image's positions — as the family's HF
    processor writes an image (``LlavaProcessor``: ``<image>`` itself; Qwen-VL's and InternVL's their blocks)."""
    block = TEMPLATE_CLASSES[name].image_block if name in TEMPLATE_CLASSES else IMAGE_TOKEN
    return block, image_token_for(name)


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
