"""Rendered conversation → ``input_ids`` and ``labels``: tokenized text, labels from character offsets.

A token is learned iff its character offsets overlap a learned span (an assistant reply or the end-of-turn text
right after it). Zero-width tokens (BOS added by the tokenizer) never are. Each ``<image>`` token is then expanded to
the image's ``num_image_tokens`` positions, all ignored. Nothing here counts tokens per turn, so the result cannot
drift from what the tokenizer produces at inference.

Two conventions (``model.data.tokenization``, recorded in checkpoints; training and serving share
``tokenize_text``):

- ``neva``: one tokenizer call on the rendering (``<image>`` a special token: what HF's ``LlavaProcessor`` does);
  learned = the replies and their end-of-turn text.
- ``llava``: what LLaVA's trainer (``llava/train/train.py``) feeds its models. Ids: ``tokenizer_image_token``, the
  text split at ``<image>`` and each chunk tokenized on its own, so a chunk after an image starts with the
  tokenizer's dummy-prefix piece (``<image>\n`` is ``[image, ▁, <0x0A>]`` with Llama's tokenizer), BOS kept only on
  the first chunk. Labels: ``preprocess_v1`` / ``preprocess_llama_2`` mask a round's instruction up to its cue minus
  the cue's trailing space (``len(tokenizer_image_token(parts[0])) - 2``), so the separator space before each reply
  is learned too; with a Llama vocabulary it is mostly merged into the reply's first token (``▁A``) and changes
  nothing, but a reply opening with a digit or a newline (``▁``, ``2``) learns the lone ``▁`` in LLaVA. Offsets are
  shifted to the whole text and that space joins the learned span, so labels stay exact character overlaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neva.constants import IGNORE_INDEX, IMAGE_TOKEN
from neva.data.errors import SampleError
from neva.data.templates.base import Rendered

TOKENIZATIONS = ("neva", "llava")


class EncodingError(SampleError):
    """A rendered sample that cannot be encoded."""


@dataclass(frozen=True)
class Encoded:
    """Token ids and aligned labels (``IGNORE_INDEX`` = not learned); image spans already expanded.

    ``truncated_from`` is the length before the sample was cut to the maximum length (None when it was not cut);
    ``dropped_leading_reply`` says a leading assistant turn was dropped before rendering (LLaVA's rule).
    """

    input_ids: list[int]
    labels: list[int]
    num_images: int
    truncated_from: int | None = None
    dropped_leading_reply: bool = False


def token_labels(offsets: list[tuple[int, int]], ids: list[int], spans: tuple[tuple[int, int], ...]) -> list[int]:
    """Label per token: its id if ``[start, end)`` overlaps one of ``spans`` (sorted, disjoint), else IGNORE_INDEX."""
    labels = []
    for tok_id, (start, end) in zip(ids, offsets):
        learned = start < end and any(s < end and start < e for s, e in spans)
        labels.append(tok_id if learned else IGNORE_INDEX)
    return labels


def tokenize_text(
    text: str, tokenizer: Any, add_special_tokens: bool, image_token_id: int, tokenization: str = "neva"
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` and their ``[start, end)`` character offsets in it, one id per ``<image>`` tag.

    ``tokenization`` is one of ``TOKENIZATIONS`` (see the module docstring).
    """
    if tokenization == "neva":
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if tokenization != "llava":
        raise ValueError(f"tokenization {tokenization!r}; choose one of {TOKENIZATIONS}")
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for k, chunk in enumerate(text.split(IMAGE_TOKEN)):
        if k:  # the tag between two chunks
            ids.append(image_token_id)
            offsets.append((pos, pos + len(IMAGE_TOKEN)))
            pos += len(IMAGE_TOKEN)
        enc = tokenizer(chunk, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        chunk_ids, chunk_offsets = list(enc["input_ids"]), [(pos + s, pos + e) for s, e in enc["offset_mapping"]]
        # LLaVA keeps the first chunk's BOS and cuts it from every later chunk (``x[offset:]``).
        skip = 1 if k and chunk_ids and chunk_ids[0] == tokenizer.bos_token_id else 0
        ids += chunk_ids[skip:]
        offsets += chunk_offsets[skip:]
        pos += len(chunk)
    return ids, offsets


def llava_learned_spans(text: str, spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """LLaVA's label rule on character spans: a reply's span also takes the space that separates it from its cue."""
    return tuple((start - 1 if start > 0 and text[start - 1] == " " else start, end) for start, end in spans)


def encode(
    rendered: Rendered,
    tokenizer: Any,
    image_token_id: int,
    num_image_tokens: int | Sequence[int],
    num_images: int,
    max_length: int | None = None,
    tokenization: str = "neva",
) -> Encoded:
    """Tokenize ``rendered.text`` and build aligned labels, expanding and length-checking image spans.

    Args:
        rendered: text and learned spans from a template.
        tokenizer: HF fast tokenizer in which ``<image>`` is a special token with id ``image_token_id``.
        image_token_id: id of ``<image>``; also the id every expanded image position carries.
        num_image_tokens: LLM positions per image, or one count per image (AnyRes: each image's own).
        num_images: images the sample has (must equal the ``<image>`` tokens found).
        max_length: truncate to this many tokens; never inside an image span (the result records the cut).
        tokenization: ``neva`` or ``llava`` (the module docstring).

    Returns:
        The encoded sample.

    Raises:
        EncodingError: ``image_count_mismatch``, ``too_long`` (an image span does not fit) or
            ``no_learned_tokens`` (nothing left to learn, e.g. after truncation).
    """
    ids, offsets = tokenize_text(rendered.text, tokenizer, rendered.add_special_tokens, image_token_id, tokenization)
    spans = rendered.learned_spans
    if tokenization == "llava":
        spans = llava_learned_spans(rendered.text, spans)
    labels = token_labels(offsets, ids, spans)
    found = ids.count(image_token_id)
    if found != num_images:
        raise EncodingError(
            "image_count_mismatch", f"{found} <image> tokens after tokenization for {num_images} images"
        )
    counts = [num_image_tokens] * num_images if isinstance(num_image_tokens, int) else list(num_image_tokens)
    out_ids: list[int] = []
    out_labels: list[int] = []
    image_ends = []
    for tok_id, label in zip(ids, labels):
        if tok_id == image_token_id:
            n = counts[len(image_ends)]
            out_ids += [image_token_id] * n
            out_labels += [IGNORE_INDEX] * n
            image_ends.append(len(out_ids))
        else:
            out_ids.append(tok_id)
            out_labels.append(label)
    if max_length is not None and len(out_ids) > max_length:
        if image_ends and image_ends[-1] > max_length:
            raise EncodingError(
                "too_long", f"{len(out_ids)} tokens; image span ends at {image_ends[-1]} > max length {max_length}"
            )
        truncated_from = len(out_ids)
        out_ids, out_labels = out_ids[:max_length], out_labels[:max_length]
    else:
        truncated_from = None
    if all(label == IGNORE_INDEX for label in out_labels):
        raise EncodingError("no_learned_tokens", f"no learned token in {len(out_ids)} tokens (max {max_length})")
    return Encoded(out_ids, out_labels, num_images, truncated_from)
