"""Independent transcription of LLaVA's ``Conversation.get_prompt`` (sep styles TWO, LLAMA_2, PLAIN) and of the
``<image>`` handling of ``preprocess_multimodal`` / ``preprocess_plain``: the oracle for our rendering."""

from __future__ import annotations

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
LLAMA_2_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the user "
    "provides, and assist the user with a variety of tasks using natural language."
)


def drop_leading_reply(source: list[dict]) -> list[dict]:
    """``preprocess_v1`` / ``preprocess_llama_2``: ``if roles[source[0]["from"]] != conv.roles[0]: source = source[1:]``
    (skip the first turn when it is not from the human)."""
    return source[1:] if source[0]["from"] != "human" else source


def preprocess_multimodal(values: list[str]) -> list[str]:
    out = []
    for v in values:
        if "<image>" in v:
            v = v.replace("<image>", "").strip()
            v = "<image>" + "\n" + v
            v = v.strip()
        out.append(v)
    return out


def get_prompt(template: str, values: list[str]) -> str:
    """``values`` alternate human, gpt."""
    if template == "plain":  # preprocess_plain: the human turn becomes just the tag
        return "<image>" + values[1] + "\n"
    values = preprocess_multimodal(values)
    if template == "vicuna_v1":
        roles, seps = ("USER", "ASSISTANT"), [" ", "</s>"]
        ret = VICUNA_SYSTEM + seps[0]
        for i, message in enumerate(values):
            ret += roles[i % 2] + ": " + message + seps[i % 2]
        return ret
    if template == "llama_2":
        sep, sep2 = "<s>", "</s>"
        ret = ""
        for i, message in enumerate(values):
            if i == 0:
                message = f"<<SYS>>\n{LLAMA_2_SYSTEM}\n<</SYS>>\n\n" + message
            if i % 2 == 0:
                ret += sep + f"[INST] {message} [/INST]"
            else:
                ret += " " + message + " " + sep2
        return ret.lstrip(sep)
    raise KeyError(template)
