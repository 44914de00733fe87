"""A tiny Gemma 3 directory as the hub ships one (transformers' own ``Gemma3ForConditionalGeneration``, random fp32
weights), written in the test: the oracle of the Gemma 3 import, model, generation and export.

Sizes exercise what differs from Llama: 4 decoder layers, sliding (window 5, shorter than the prompts) and global
ones with their own RoPE bases (the global one linearly scaled), an attention scale that is not head_dim's, GQA, and
a SigLIP tower at 28 px / 7 px patches (a 4×4 grid) pooled to 4 tokens per image.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from tests.hf_oracle import randomise_inits

VOCAB = 300
BOI, IMAGE, EOI = 297, 298, 299  # <start_of_image>, <image_soft_token>, <end_of_image>
TOKENS_PER_IMAGE = 4
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, sliding_window=5, query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 100_000.0, "factor": 4.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
    max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7,
    layer_norm_eps=1e-6, vision_use_head=False,
)  # fmt: skip


def tiny_gemma3(seed: int = 0) -> Gemma3ForConditionalGeneration:
    """A random ``Gemma3ForConditionalGeneration`` (fp32, eval mode); its norms and the projector randomised (HF
    zero-initialises them)."""
    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config=Gemma3TextConfig(**TEXT),
        vision_config=SiglipVisionConfig(**VISION),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )
    model = Gemma3ForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    return model


def tiny_gemma3_dir(root: Path, seed: int = 0) -> tuple[Gemma3ForConditionalGeneration, Path]:
    """The model, its tokenizer (with the chat template) and its processor written as a hub directory."""
    model = tiny_gemma3(seed)
    directory = root / "gemma3-hf"
    model.save_pretrained(directory)
    make_processor(make_tokenizer()).save_pretrained(directory)
    return model, directory


# Gemma 3's chat template (google/gemma-3-4b-it tokenizer_config.json), the oracle neva's gemma3 template must equal.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def make_tokenizer():
    """A Gemma tokenizer over a tiny vocabulary of the model's size: Gemma's specials at Gemma's ids (pad 0, eos 1,
    bos 2), byte fallback, single characters, then the turn and image tokens at the config's ids."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    for piece in ["▁", "\n", *"abcdefghijklmnopqrstuvwxyz", *"?.,!:'"]:
        vocab[piece] = len(vocab)
    for special in ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"):
        vocab[special] = len(vocab)
    assert len(vocab) == VOCAB and vocab["<image_soft_token>"] == IMAGE
    tokenizer = GemmaTokenizer(
        vocab=vocab, merges=[], add_bos_token=True,
        extra_special_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                              "eoi_token": "<end_of_image>"},
    )  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_processor(tokenizer):
    """``Gemma3Processor`` at the tiny tower's size (the PIL image processor: bilinear, 0.5 / 0.5)."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    images = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    return Gemma3Processor(images, tokenizer, chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS_PER_IMAGE)


def hf_messages(record: dict) -> list[dict]:
    """A LLaVA-format record's turns as Gemma 3's chat template takes them: content lists of text and images, in
    the order of the record's ``<image>`` tags."""
    out = []
    for turn in record["conversations"]:
        role = "user" if turn["from"] == "human" else "assistant"
        parts = turn["value"].split("<image>")
        content = [{"type": "text", "text": parts[0]}]
        for part in parts[1:]:
            content += [{"type": "image"}, {"type": "text", "text": part}]
        out.append({"role": role, "content": content})
    return out
