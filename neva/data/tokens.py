"""What a tokenizer must hold for neva: the one id of ``<image>``.

Its own module (no DataLoader imports) because the architecture side asks it too: a run's ``image_token_id`` is the
tokenizer's (``neva.checkpoint.architecture``), and the data side checks the model's against it.
"""

from __future__ import annotations

from typing import Any

from neva.constants import IMAGE_TOKEN


def tokenizer_image_token_id(tokenizer: Any) -> int:
    """Id of ``<image>``; it must be a special token of the tokenizer.

    Raises:
        ValueError: the tokenizer does not know ``<image>`` as one token.
    """
    ids = tokenizer(IMAGE_TOKEN, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"tokenizer splits {IMAGE_TOKEN!r} into {len(ids)} tokens; add it as a special token "
            f"(tokenizer.add_special_tokens({{'additional_special_tokens': ['{IMAGE_TOKEN}']}}))"
        )
    return ids[0]
