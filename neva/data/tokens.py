"""What a tokenizer must hold for neva: the one id of its image token (``<image>``, or the one a family's template
writes: ``neva.data.templates.registry.image_token_for``).

Its own module (no DataLoader imports) because the architecture side asks it too: a run's ``image_token_id`` is the
tokenizer's (``neva.checkpoint.architecture``), and the data side checks the model's against it.
"""

from __future__ import annotations

from typing import Any

from neva.constants import IMAGE_TOKEN

PAD_TOKEN = "<pad>"  # what a tokenizer without a pad token gets (llava-hf's)


def tokenizer_image_token_id(tokenizer: Any, token: str = IMAGE_TOKEN) -> int:
    """Id of the image token ``token`` (``image_token_for`` the run's template, ``neva.data.templates.registry``); it
    must be a special token of the tokenizer.

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
