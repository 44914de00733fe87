"""Tiny HF artefacts made on the spot (no hub): a sentencepiece Llama tokenizer and llava-hf / Llama / CLIP dirs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaTokenizer,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)

from tests.hf_oracle import SIGLIP_KW, TEXT_KW, VISION_KW, tiny_llava

SP_VOCAB = 320  # 3 specials + 256 byte-fallback pieces + merges
LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A cat sits on the mat next to a red ball.",
    "What is in the image? Describe it in detail.",
    "USER: ASSISTANT: a picture of a red square and a blue circle",
    "hello world, this is a tiny tokenizer for tests 0123456789",
]


def make_tokenizer(directory: Path, vision_tokens: bool = True) -> LlamaTokenizer:
    """A Llama (sentencepiece BPE, byte fallback) tokenizer; with ``vision_tokens``, ``<pad>``=320 and ``<image>``=321."""
    directory.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 10),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=SP_VOCAB,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    tokenizer = LlamaTokenizer.from_pretrained(str(directory), add_bos_token=True, legacy=False)
    if vision_tokens:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
        tokenizer.add_special_tokens({"extra_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
    return tokenizer


def processor_for(model: LlavaForConditionalGeneration, tokenizer: LlamaTokenizer) -> LlavaProcessor:
    """The LlavaProcessor llava-hf ships for this model's vision config (CLIP or SigLIP)."""
    v = model.config.vision_config
    siglip = v.model_type == "siglip_vision_model"
    if siglip:
        image_processor = SiglipImageProcessor(size={"height": v.image_size, "width": v.image_size})
    else:
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": v.image_size}, crop_size={"height": v.image_size, "width": v.image_size}
        )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=v.patch_size,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=0 if siglip else 1,
    )


def make_llava_dir(
    directory: Path, seed: int = 0, tower: str = "clip"
) -> tuple[LlavaForConditionalGeneration, LlamaTokenizer]:
    """Save a tiny random llava-hf model (transformers' own layout), its tokenizer and processor to ``directory``."""
    tokenizer = make_tokenizer(directory / "_sp")
    assert tokenizer.convert_tokens_to_ids("<image>") == SP_VOCAB + 1
    model = tiny_llava(seed, text_kw={"vocab_size": SP_VOCAB + 2, "pad_token_id": SP_VOCAB}, tower=tower)
    model.save_pretrained(str(directory))
    processor_for(model, tokenizer).save_pretrained(str(directory))
    return model, tokenizer


def make_llama_dir(directory: Path, seed: int = 1) -> tuple[LlamaForCausalLM, LlamaTokenizer]:
    """A tiny random HF Llama with a tokenizer that has no ``<image>`` and no pad token."""
    tokenizer = make_tokenizer(directory / "_sp", vision_tokens=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TEXT_KW, "vocab_size": SP_VOCAB})).eval()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return model, tokenizer


def make_clip_dir(directory: Path, seed: int = 2) -> CLIPModel:
    """A tiny random full CLIPModel (text tower included, which the import must skip)."""
    torch.manual_seed(seed)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=VISION_KW, projection_dim=8)).eval()
    model.save_pretrained(str(directory))
    return model


@contextmanager
def one_thread() -> Iterator[None]:
    """Run tiny models single-threaded: on a busy 2-core machine, intra-op threads only add waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_siglip_dir(directory: Path, seed: int = 4) -> SiglipModel:
    """A tiny random full SiglipModel (text tower and the vision pooling head included: the import must skip both)."""
    torch.manual_seed(seed)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=SIGLIP_KW)).eval()
    model.save_pretrained(str(directory))
    SiglipImageProcessor(size={"height": SIGLIP_KW["image_size"], "width": SIGLIP_KW["image_size"]}).save_pretrained(
        str(directory)
    )
    return model
