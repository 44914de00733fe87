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


IMAGE_TOKEN_INDEX = -200


def tokenizer_image_token(prompt: str, tokenizer) -> list[int]:
    """``llava/mm_utils.py: tokenizer_image_token``: chunks between ``<image>`` tags tokenized one by one (BOS of the
    first chunk kept, every later chunk's first token cut when the first chunk began with BOS), -200 between them."""
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    offset = 1 if chunks and chunks[0] and chunks[0][0] == tokenizer.bos_token_id else 0
    ids = [chunks[0][0]] if offset else []
    separator = [IMAGE_TOKEN_INDEX] * (offset + 1)
    separated = [piece for chunk in chunks for piece in (chunk, separator)][:-1]  # insert_separator
    for piece in separated:
        ids.extend(piece[offset:])
    return ids


def _tokens(text: str, tokenizer, has_image: bool) -> list[int]:
    return tokenizer_image_token(text, tokenizer) if has_image else tokenizer(text).input_ids


def llava_labels(template: str, prompt: str, values: list[str], tokenizer, has_image: bool) -> list[int]:
    """The targets of ``preprocess_plain`` / ``preprocess_v1`` / ``preprocess_llama_2`` (llava-torch 1.2.2.post1)."""
    ids = _tokens(prompt, tokenizer, has_image)
    target = list(ids)
    if template == "plain":
        masked = len(tokenizer_image_token("<image>", tokenizer))
        return [-100] * masked + target[masked:]
    sep, sep2 = {"vicuna_v1": (" ASSISTANT: ", "</s>"), "llama_2": ("[/INST] ", "</s>")}[template]
    cur = 1
    target[:cur] = [-100] * cur
    for i, rou in enumerate(prompt.split(sep2)):
        if rou == "":
            break
        parts = rou.split(sep)
        if len(parts) != 2:
            break
        parts[0] += sep
        round_len = len(_tokens(rou, tokenizer, has_image))
        instruction_len = len(_tokens(parts[0], tokenizer, has_image)) - 2
        if template == "vicuna_v1" and i != 0 and not tokenizer.legacy:  # tokenizers >= 0.14
            round_len -= 1
            instruction_len -= 1
        target[cur : cur + instruction_len] = [-100] * instruction_len
        cur += round_len
    target[cur:] = [-100] * (len(target) - cur)
    assert cur == len(ids), f"LLaVA's tokenization mismatch: {cur} vs. {len(ids)}"
    return target
