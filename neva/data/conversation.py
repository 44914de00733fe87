"""LLaVA-format records' conversations → validated messages, with their ``<image>`` tags placed as LLaVA does.

The messages are then rendered by a conversation template (``neva.data.templates``).
"""

from __future__ import annotations

from typing import Any

from neva.constants import IMAGE_TOKEN
from neva.data.templates.base import ASSISTANT, SYSTEM, USER, ConversationError, Message

_ROLE_NAMES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "system": SYSTEM}


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
