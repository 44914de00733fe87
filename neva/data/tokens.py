"""What a tokenizer must hold for neva: the one id of its image token (``<image>``, or Qwen-VL's ``<|image_pad|>``).

Its own module (no DataLoader imports) because the architecture side asks it too: a run's ``image_token_id`` is the
tokenizer's (``neva.checkpoint.architecture``), and the data side checks the model's against it.
"""

from __future__ import annotations

from typing import Any

from neva.constants import IMAGE_TOKEN

PAD_TOKEN = "<pad>"  # what a tokenizer without a pad token gets (llava-hf's)
QWEN_IMAGE_PAD = "<|image_pad|>"
# The image token of the templates whose text writes an <image> tag as something else (Qwen-VL's vision block,
# neva.data.conversation.QwenVLTemplate); every other template keeps the tag itself as the token. By template, not
# by what a tokenizer holds: Qwen2.5's text tokenizers carry <|image_pad|> too, and LLaVA-OneVision trains them with
# <image>.
INTERNVL_IMAGE_CONTEXT = "<IMG_CONTEXT>"  # InternVL's image token (its tokenizer's ``context_image_token``)
GLM4V_IMAGE = "<|image|>"  # GLM-4.1V's image token (Glm4vProcessor's ``image_token``)
PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"  # Mistral 3's (PixtralProcessor's)
IMAGE_TOKEN_OF_TEMPLATE = {
    "qwen2_vl": QWEN_IMAGE_PAD,
    "qwen3_vl": QWEN_IMAGE_PAD,
    "gemma3": "<image_soft_token>",
    "internvl": INTERNVL_IMAGE_CONTEXT,
    "glm4v": GLM4V_IMAGE,
    "mistral3": PIXTRAL_IMAGE,
}


def image_token_for(template: str | None) -> str:
    """The image token text of conversation template ``template``."""
    return IMAGE_TOKEN_OF_TEMPLATE.get(template or "", IMAGE_TOKEN)


def tokenizer_image_token_id(tokenizer: Any, token: str = IMAGE_TOKEN) -> int:
    """Id of the image token ``token`` (``image_token_for`` the run's template); it must be a special token of the
    tokenizer.

    Raises:
        ValueError: the tokenizer does not know ``token`` as one token.
    """
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"tokenizer splits {token!r} into {len(ids)} tokens; add it as a special token "
            f"(tokenizer.add_special_tokens({{'additional_special_tokens': ['{token}']}}))"
        )
    return ids[0]


def add_vision_tokens(tokenizer: Any) -> None:
    """Add ``<image>`` as a special token, and ``<pad>`` if there is no pad token (llava-hf's order): what training
    does to an HF LLM's tokenizer (``model.mm_cfg.llm.from_pretrained``), and ``neva.data.preview`` too."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        # An extra special token: never split, and skipped by decode(skip_special_tokens=True).
        tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def add_special_tokens(tokenizer: Any, tokens: list[str]) -> None:
    """Add ``tokens`` the tokenizer lacks as extra special tokens (never split; a family's image text tokens)."""
    missing = [t for t in tokens if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
