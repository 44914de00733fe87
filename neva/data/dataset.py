"""``ConversationDataset``: record → processed sample, or a skip marker naming the reason.

Order of checks (cheapest first): unreadable record → conversation structure (and no ``<image>`` in a reply) →
tag/image count → image paths → render + tokenize + length → image decode. Every failure becomes
``{"id", "skipped": reason, "detail"}``; the collate functions count them per batch, ``SkipTracker`` turns the counts
into metrics and the stop rule. A sample cut to the maximum length is kept, and counted as ``truncated``; one whose
leading assistant turn was dropped (LLaVA's rule) is kept, and counted as ``dropped_leading_reply``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from neva.constants import IMAGE_TOKEN, VIDEO_TOKEN
from neva.data.conversation import place_image_tags, read_conversation
from neva.data.encoding import Encoded, encode
from neva.data.errors import SampleError
from neva.data.front_ends import FrontEnd
from neva.data.images import ImageSource, safe_relative_path
from neva.data.records import ERROR_KEY, approx_length, record_images, record_videos
from neva.data.templates.base import ASSISTANT, ConversationError, Template
from neva.data.video import IMAGE, VideoSource, load_videos, tag_kinds, video_sample_fields
from neva.data.visual_budget import VisualBudget, fit_record

log = logging.getLogger(__name__)

_LOG_FIRST = 20  # per reason and process: enough to diagnose, without flooding the log on a bad 600K-record file


@dataclass
class EncoderSettings:
    """Everything that turns a record into token ids (shared by the datasets and the preview CLI)."""

    tokenizer: Any
    template: Template
    image_token_id: int
    num_image_tokens: int
    max_length: int | None
    image_token_placement: str = "front"
    system_prompt: str | None = None
    tokenization: str = "neva"
    # Video (``neva.data.video``): positions of one video of F frames (``NevaConfig.video_tokens``; None: the model
    # takes no video), the id its positions carry (None: ``image_token_id``) and the frames a video gives at most.
    video_tokens: Callable[[int], int] | None = None
    video_token_id: int | None = None
    num_frames: int = 8
    # ``model.data.max_visual_tokens`` and what past it (``neva.data.visual_budget``); None: no budget
    visual_budget: VisualBudget | None = None


def is_skipped(sample: dict[str, Any]) -> bool:
    """True for a skip marker."""
    return "skipped" in sample


def skip_marker(sample_id: Any, reason: str, detail: str = "") -> dict[str, Any]:
    """The marker the dataset returns instead of a sample."""
    return {"id": sample_id, "skipped": reason, "detail": detail}


class SkipLogger:
    """Logs the first skips of each reason in full, then only counts them."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, marker: dict[str, Any]) -> None:
        reason = marker["skipped"]
        self.counts[reason] += 1
        if self.counts[reason] <= _LOG_FIRST:
            log.warning("skipping sample %s: %s (%s)", marker["id"], reason, marker.get("detail", ""))
            if self.counts[reason] == _LOG_FIRST:
                log.warning("further '%s' skips are counted but not logged", reason)


def encode_record(
    record: dict[str, Any],
    settings: EncoderSettings,
    image_tokens: list[int] | None = None,
    video_frames: list[int] | None = None,
) -> tuple[Encoded, list[str]]:
    """Text side of a record: validated, rendered, tokenized; returns ``(encoded, image_names)``.

    ``image_tokens``: positions of each image when they vary (AnyRes); None: ``settings.num_image_tokens`` each.
    ``video_frames``: frames of each of the record's videos (``encode_media_record``).

    Raises:
        SampleError: with the skip reason (``ConversationError``, ``EncodingError`` or ``ImageError``).
    """
    enc, names, _ = encode_media_record(record, settings, image_tokens, video_frames)
    return enc, names


def encode_media_record(
    record: dict[str, Any],
    settings: EncoderSettings,
    image_tokens: list[int] | None = None,
    video_frames: list[int] | None = None,
    video_tokens: list[int] | None = None,
) -> tuple[Encoded, list[str], list[tuple[str, int]]]:
    """``encode_record`` plus ``(kind, positions)`` of every visual tag in sequence order (``image`` / ``video``).

    A video of F frames takes ``settings.video_tokens(F)`` positions (``neva.data.video``), or its entry of
    ``video_tokens`` where given (a native-resolution video: its count follows from its frames' size).
    """
    if ERROR_KEY in record:
        raise ConversationError(record[ERROR_KEY], record.get("detail", ""))
    messages, dropped = read_conversation(record.get("conversations"))
    # An image placed in a reply would sit inside the learned span: the model would be trained to emit it.
    for i, message in enumerate(messages):
        for token, reason in ((IMAGE_TOKEN, "image_in_reply"), (VIDEO_TOKEN, "video_in_reply")):
            if message.role == ASSISTANT and token in message.content:
                raise ConversationError(reason, f"turn {i} (assistant) holds {token}")
    images = record_images(record)
    video_frames = video_frames or []
    messages, kinds = tag_kinds(messages, len(images), len(video_frames))
    tags = kinds.count(IMAGE)
    if tags != len(images):
        raise ConversationError("image_count_mismatch", f"{tags} <image> tags for {len(images)} images")
    names = [safe_relative_path(name) for name in images]
    per_image = iter([settings.num_image_tokens] * len(images) if image_tokens is None else image_tokens)
    per_video = iter([settings.video_tokens(f) for f in video_frames] if video_tokens is None else video_tokens)
    counts = [next(per_image) if kind == IMAGE else next(per_video) for kind in kinds]
    messages = place_image_tags(messages, settings.image_token_placement)
    rendered = settings.template.render(messages, settings.system_prompt)
    enc = encode(
        rendered,
        settings.tokenizer,
        settings.image_token_id,
        counts,
        len(counts),
        settings.max_length,
        settings.tokenization,
    )
    return (dataclasses.replace(enc, dropped_leading_reply=True) if dropped else enc), names, list(zip(kinds, counts))


def process_record(
    record: dict[str, Any],
    settings: EncoderSettings,
    image_source: ImageSource,
    front_end: FrontEnd,
    video_source: VideoSource | None = None,
) -> dict[str, Any]:
    """One record → ``{"id", "input_ids", "image_positions", "labels", "pixel_values", "image_count", "truncated",
    "dropped_leading_reply"}`` (the model's front end adds its layout fields; with videos, ``video_pixel_values``,
    ``video_frames``, ``video_positions``) or a skip marker.

    ``truncated`` (the sample was cut to the maximum length) is not a skip; the collate functions count it.
    Videos are decoded first: a video's positions follow from the frames it gives.
    """
    sample_id = record.get("id") if isinstance(record, dict) else None
    action = None
    try:
        videos = load_videos(record_videos(record) if isinstance(record, dict) else [], settings, video_source)
        if settings.visual_budget is not None and isinstance(record, dict):
            front_end, image_source, videos, action = fit_record(
                settings.visual_budget, record, settings.num_image_tokens, image_source, front_end, videos,
                settings.video_tokens,
            )  # fmt: skip
        frames = [len(v.frames) for v in videos]
        encoded = front_end.encode(
            record,
            lambda tokens, video_tokens=None: encode_media_record(record, settings, tokens, frames, video_tokens),
            image_source,
            videos,
        )
    except SampleError as exc:
        return skip_marker(sample_id, exc.reason, exc.detail)
    enc = encoded.encoding
    input_ids = torch.tensor(enc.input_ids, dtype=torch.long)
    extra = dict(encoded.fields)
    # Where the image features go (``encode`` checked their number): the collator turns them into batch
    # positions, so the model splices by index without counting on the device.
    image_positions = (input_ids == settings.image_token_id).nonzero().flatten()
    if videos and "video_positions" not in extra:  # the front end made no tower inputs of its own of them
        video_fields = video_sample_fields(videos, video_source, image_positions, encoded.tags)
        image_positions = video_fields.pop("image_positions")
        if settings.video_token_id is not None:
            input_ids[video_fields["video_positions"]] = settings.video_token_id
        extra.update(video_fields)
    return {
        **extra,
        "id": sample_id,
        "input_ids": input_ids,
        "image_positions": image_positions,
        "labels": torch.tensor(enc.labels, dtype=torch.long),
        # the tower inputs: one [3, s, s] per fixed-size image; every AnyRes image's tiles in image order
        "pixel_values": encoded.pixels,
        "image_count": encoded.images,
        "truncated": enc.truncated_from is not None,
        "dropped_leading_reply": enc.dropped_leading_reply,
        **({"visual_budget": action} if action else {}),  # what the visual budget did to it (counted, logged)
    }


class ConversationDataset(Dataset):
    """Map-style dataset over LLaVA records (from files, or generated)."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        settings: EncoderSettings,
        image_source: ImageSource,
        front_end: FrontEnd,
        video_source: VideoSource | None = None,
    ) -> None:
        self.records = records
        self.settings = settings
        self.image_source = image_source
        self.front_end = front_end
        self.video_source = video_source
        self._log = SkipLogger()
        self._budget_counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = process_record(
            self.records[index], self.settings, self.image_source, self.front_end, self.video_source
        )
        if is_skipped(sample):
            self._log(sample)
        elif sample.get("visual_budget"):
            self._log_budget(sample)
        return sample

    def _log_budget(self, sample: dict[str, Any]) -> None:
        action = sample["visual_budget"]
        self._budget_counts[action] += 1
        if self._budget_counts[action] <= _LOG_FIRST:
            frames = sample.get("video_frames")
            what = f"its videos cut to {frames.tolist()} frames" if action == "fewer_frames" else "downscaled"
            log.warning("sample %s over model.data.max_visual_tokens: %s (%s)", sample["id"], what, action)

    def modality_lengths(self) -> list[int]:
        """Approximate lengths, negative for text-only records (for the grouped sampler); AnyRes images count their
        real positions, from their sizes (image headers, not decoded); a video its positions at ``num_frames``."""
        s = self.settings
        per_video = s.video_tokens(s.num_frames) if s.video_tokens is not None else 0
        return [
            approx_length(r, s.num_image_tokens, self.front_end.record_tokens(r, self.image_source), per_video)
            for r in self.records
        ]

    def token_lengths(self) -> list[int]:
        """Each record's decoder positions (text tokens as the tokenizer gives them, visual positions by the front end's
        rule, a video at ``num_frames``; at most the sequence length), 0 for a record skipped when read: what the
        token budget (``neva.data.token_budget``) fills micro-batches with, before any image or video is decoded.
        Renders and tokenizes every record once."""
        s = self.settings
        whole = dataclasses.replace(s, max_length=None)  # cut below, as the encoder cuts
        out = []
        for record in self.records:
            try:
                varying = self.front_end.record_tokens(record, self.image_source)
                frames = [s.num_frames] * len(record_videos(record))
                enc, names, _ = encode_media_record(record, whole, None, frames)
            except (SampleError, AttributeError, TypeError):
                out.append(0)
                continue
            n = len(enc.input_ids)
            if varying is not None:  # AnyRes / native: the images' positions from their sizes, not the fixed count
                n += varying - len(names) * s.num_image_tokens
            out.append(min(n, s.max_length) if s.max_length is not None else n)
        return out

    def tower_patches(self) -> list[int] | None:
        """Each record's tower patches from its images' headers where the front end's vary with image size (native
        resolution; for ``neva.data.patch_balance``), else None."""
        patches = []
        for record in self.records:  # a fixed-size front end answers None for the first record: no pass over all
            n = self.front_end.record_patches(record, self.image_source)
            if n is None:
                return None
            patches.append(n)
        return patches
