"""Preference pairs (DPO): record → a chosen and a rejected sample with one prompt → a concatenated batch.

Two record formats, JSON or JSONL (``neva.data.records.load_records``):

- LLaVA-NeXT's DPO records (``llava/train/train_dpo.py``): ``id``, ``image`` (a name or a list) or ``video``,
  ``prompt`` (a user turn holding ``<image>``), ``chosen`` and ``rejected`` (reply strings);
- TRL's conversational preference records: ``prompt`` a message list (``role`` / ``content``; content a string, or
  TRL's parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}``), ``chosen`` / ``rejected`` one assistant
  message each, ``images`` the image names.

Each pair becomes two LLaVA conversations, the prompt's turns then the reply, encoded by the finetuning path
(``neva.data.dataset.process_record``: the run's template, exact masks), so the prompt renders exactly as a user turn
of finetuning and the reply as that turn's answer. Only the final reply (and its end-of-turn text) is learned: an
assistant turn inside a multi-turn prompt is context. Bad pairs are counted skips, one reason each (``BAD_PAIRS``).
Precomputed reference log-probs ride in the records as TRL names them (``ref_chosen_logps``, ``ref_rejected_logps``).

The collator puts a micro-batch's chosen samples in its first rows and their rejected samples, in the same order, in
the rows after (TRL's concatenated batch): one forward scores both sides of every pair, and each pair's images (or
video) are encoded once, the rejected rows reading the chosen rows' features (``pair_media``). Packed
(``model.data.packing``), the same sequences share rows and the batch says which sequence each learned position is
of (``packed_sequences``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Dataset

from neva.constants import IGNORE_INDEX, IMAGE_TOKEN
from neva.data.collate import collate_packed, collate_padded, first_fit
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule, pad_token_id
from neva.data.dataset import ConversationDataset, SkipLogger, is_skipped, process_record, skip_marker
from neva.data.errors import SampleError
from neva.data.micro_batch import MicroBatch, PreferencePairs
from neva.data.records import ERROR_KEY, approx_length, record_images, record_videos
from neva.errors import ConfigError
from neva.models.media import Media

REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")

# Skip reason of each bad pair (counted like every skipped sample: metrics.csv's skipped_* columns, max_skip_fraction).
BAD_PAIRS = {
    "no_image": "a preference record without an image or a video (neva's DPO stage trains grounded replies)",
    "empty_chosen": "the chosen reply is empty",
    "empty_rejected": "the rejected reply is empty",
    "chosen_equals_rejected": "chosen and rejected are the same text: the pair carries no preference",
    "malformed_pair": "prompt / chosen / rejected missing or of the wrong type",
    "no_reference_logps": "model.dpo.precompute_ref_log_probs=true and the record lacks ref_chosen_logps / "
    "ref_rejected_logps",
}


class PairError(SampleError):
    """A preference record that cannot be a pair (``BAD_PAIRS``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail or BAD_PAIRS[reason])


def _text(content: Any) -> str:
    """A message's content as neva's text: TRL's image parts become ``<image>`` tags in place."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, (str, dict)) for p in content):
        raise PairError("malformed_pair", f"message content {content!r:.80}")
    parts = [p if isinstance(p, str) else IMAGE_TOKEN if p.get("type") == "image" else str(p.get("text", ""))
             for p in content]  # fmt: skip
    return "\n".join(parts)


def _messages(value: Any, role: str) -> list[dict[str, str]]:
    """A prompt or reply as ``role`` / ``content`` turns: a string is one turn of ``role``."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise PairError("malformed_pair", f"{role} value {value!r:.80}")
    return [{"role": m.get("role", m.get("from", role)), "content": _text(m.get("content", m.get("value")))}
            for m in value]  # fmt: skip


def _reply(record: dict[str, Any], key: str) -> str:
    turns = _messages(record.get(key), "assistant")
    if len(turns) != 1:
        raise PairError("malformed_pair", f"{key} holds {len(turns)} messages, not one reply")
    return turns[0]["content"]


def pair_conversations(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (chosen, rejected) LLaVA records of a preference record.

    Raises:
        SampleError: a ``BAD_PAIRS`` reason, or the record's own read error.
    """
    if ERROR_KEY in record:
        raise SampleError(record[ERROR_KEY], record.get("detail", ""))
    if "prompt" not in record or "chosen" not in record or "rejected" not in record:
        raise PairError("malformed_pair", f"keys {sorted(record)}")
    images, videos = record_images(record), record_videos(record)
    if not images and not videos:
        raise PairError("no_image")
    prompt = _messages(record["prompt"], "user")
    chosen, rejected = _reply(record, "chosen"), _reply(record, "rejected")
    if not chosen.strip():
        raise PairError("empty_chosen")
    if not rejected.strip():
        raise PairError("empty_rejected")
    if chosen.strip() == rejected.strip():
        raise PairError("chosen_equals_rejected")
    # A video pair (LLaVA-NeXT's train_dpo.py reads ``video`` as finetuning does) keeps the finetuning record's keys:
    # its ``<image>`` / ``<video>`` tags are then the video's (neva.data.video).
    base = {"id": record.get("id"), **({"image": images} if images else {}), **({"video": videos} if videos else {})}

    def conversation(reply: str) -> dict[str, Any]:
        return {**base, "conversations": [*prompt, {"role": "assistant", "content": reply}]}

    return conversation(chosen), conversation(rejected)


def last_reply_only(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with only the final learned run kept: the pair's reply and its end-of-turn text."""
    learned = (labels != IGNORE_INDEX).nonzero().flatten()
    gaps = (learned[1:] != learned[:-1] + 1).nonzero().flatten()
    start = int(learned[gaps[-1] + 1]) if gaps.numel() else 0
    out = labels.clone()
    out[:start] = IGNORE_INDEX
    return out


def carries_reference(record: Any) -> bool:
    """The record carries its own reference log-probs (TRL's precomputed columns)."""
    values = [record.get(k) for k in REFERENCE_KEYS] if isinstance(record, dict) else [None]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _reference(record: dict[str, Any]) -> torch.Tensor:
    values = [record.get(k) for k in REFERENCE_KEYS]
    if not carries_reference(record):
        raise PairError("no_reference_logps")
    return torch.tensor(values, dtype=torch.float32)


class PreferenceDataset(Dataset):
    """Pairs over a ``ConversationDataset``'s encoder, image and video sources (the finetuning path's pieces).

    An item is ``{"id", "chosen": sample, "rejected": sample}`` (with ``ref_logps`` ``[2]`` when ``precomputed``) or
    a skip marker."""

    def __init__(self, conversations: ConversationDataset, precomputed: bool) -> None:
        self.base = conversations
        self.precomputed = precomputed
        self._log = SkipLogger()
        # The run's precomputed reference log-probs ``[N, 2]`` of the records that carry none
        # (``neva.training.reference_logps``; NaN: none), or None.
        self.reference_table: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.base.records)

    def _pair(self, record: Any, index: int, reference: bool) -> dict[str, Any]:
        if not isinstance(record, dict):
            raise PairError("malformed_pair", f"record {record!r:.80}")
        pair: dict[str, Any] = {"id": record.get("id")}
        if reference:
            table = self.reference_table
            if table is not None and not carries_reference(record) and bool(table[index].isfinite().all()):
                pair["ref_logps"] = table[index]
            else:
                pair["ref_logps"] = _reference(record)
        for side, conversation in zip(("chosen", "rejected"), pair_conversations(record)):
            b = self.base
            sample = process_record(conversation, b.settings, b.image_source, b.front_end, b.video_source)
            if is_skipped(sample):
                return sample
            pair[side] = {**sample, "labels": last_reply_only(sample["labels"])}
        return pair

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.item(index, self.precomputed)
        if is_skipped(pair):
            self._log(pair)
        return pair

    def item(self, index: int, reference: bool) -> dict[str, Any]:
        """The pair at ``index`` (a skip marker for a bad one, not logged); with its reference log-probs when
        ``reference`` (the precompute pass scores the pairs without)."""
        record = self.base.records[index]
        try:
            return self._pair(record, index, reference)
        except SampleError as exc:
            return skip_marker(record.get("id") if isinstance(record, dict) else None, exc.reason, exc.detail)

    def modality_lengths(self) -> list[int]:
        """The chosen conversation's approximate length (the grouped sampler's key); 1 for a bad record."""
        s = self.base.settings
        out = []
        for record in self.base.records:
            try:
                out.append(approx_length(pair_conversations(record)[0], s.num_image_tokens))
            except (SampleError, AttributeError, TypeError):
                out.append(1)
        return out


class PairCollator:
    """Pairs → one batch of the ``2P`` sequences, the chosen ones (``0..P-1``) then their rejected ones (``P..2P-1``,
    the same order): padded, sequence i in row i; or packed (``packing``), all of them first-fit into rows of
    ``seq_length``, with ``output_sequences`` ``[T]`` the sequence each learned position belongs to. ``pairs`` =
    ``num_samples`` = P, and ``ref_logps`` ``[2P]`` (same order) for precomputed reference log-probs."""

    def __init__(self, pad_id: int, seq_length: int, pad_to_multiple_of: int = 64, packing: bool = False) -> None:
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packing = packing

    def __call__(self, batch: list[dict[str, Any]]) -> MicroBatch:
        good = [p for p in batch if not is_skipped(p)]
        markers = [p for p in batch if is_skipped(p)]
        sequences = [p["chosen"] for p in good] + [p["rejected"] for p in good]
        output_sequences = None
        if self.packing:
            out = collate_packed(sequences + markers, self.pad_id, self.seq_length, self.pad_to_multiple_of)
            output_sequences = packed_sequences(out, [s["input_ids"].numel() for s in sequences], self.seq_length)
        else:
            out = collate_padded(sequences + markers, self.pad_id, self.pad_to_multiple_of, self.seq_length)
        if good and out.media is not None and not self.packing:
            chosen = collate_padded([p["chosen"] for p in good], self.pad_id, self.pad_to_multiple_of, self.seq_length)
            out = out.with_(media=pair_media(out.media, chosen.media, len(good)))
        ref_logps = None
        if good and "ref_logps" in good[0]:
            refs = torch.stack([p["ref_logps"] for p in good])
            ref_logps = torch.cat([refs[:, 0], refs[:, 1]])
        return out.with_(
            # a sample of this stage is a pair (samples/s, skip fraction)
            counts=replace(out.counts, num_samples=len(good)),
            stage=PreferencePairs(pairs=len(good), ref_logps=ref_logps, output_sequences=output_sequences),
        )


def packed_sequences(batch: MicroBatch, lengths: list[int], seq_length: int) -> torch.Tensor:
    """``[T]``: the sequence (index into the collated samples) of each of ``batch``'s ``output_positions``, the
    samples of ``lengths`` packed as ``collate_packed`` packs them (first-fit in order: row r's k-th segment is the
    k-th sample of bin r). A learned position predicts a token of its own sample (a sample's first label is never
    learned), so its segment names the sequence."""
    segments = batch.segment_ids
    owner = torch.full_like(segments, -1)
    for r, samples in enumerate(first_fit(lengths, seq_length)):
        for k, i in enumerate(samples, start=1):
            owner[r][segments[r] == k] = i
    positions = batch.output_positions
    return owner[positions[:, 0], positions[:, 1]]


def pair_media(both: Media, chosen: Media, pairs: int) -> Media:
    """``both`` (the media of the ``2 · pairs`` rows) with each pair's items encoded once: the tower inputs of the
    chosen rows only, whose features the rejected rows read again (``MediaInputs.feature_rows``). A pair's rows share
    the prompt, and with it every item and its columns (a placeholder never sits in a reply), so the rejected rows'
    positions are the chosen rows' ``pairs`` rows down; a modality where they are not keeps both sides' inputs."""
    out = {}
    for modality, inputs in both.items():
        once = getattr(chosen, modality)
        if inputs is not None and once is not None:
            positions = torch.cat([once.positions, once.positions + torch.tensor([pairs, 0])])
            if torch.equal(positions, inputs.positions):
                # the positions and their per-row / per-item counts stay those of every row; what is encoded
                # (pixels, AnyRes index and weights, frames, grids) is the chosen rows'
                rows = torch.arange(once.positions.shape[0]).repeat(2)
                inputs = replace(once, positions=positions, items_per_row=inputs.items_per_row,
                                 tokens=inputs.tokens, feature_rows=rows)  # fmt: skip
        out[modality] = inputs
    return Media(**out)


class PreferenceDataModule(NevaDataModule):
    """``NevaDataModule`` whose datasets are preference pairs and whose batches are concatenated pairs (padded rows, or
    under ``model.data.packing`` every sequence of the micro-batch packed into rows: ``PairCollator``).

    ``precomputed``: reference log-probs come from the records (``model.dpo.precompute_ref_log_probs``)."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, model_config: Any = None, *, precomputed: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(cfg, tokenizer, model_config, **kwargs)
        self.precomputed = precomputed
        self.collator = PairCollator(pad_token_id(tokenizer), self.seq_length, cfg.pad_to_multiple_of, cfg.packing)

    def _dataset(
        self, records: list[dict[str, Any]], images: Callable[[int, int], Any] | None, video_folder: str | None = None
    ) -> PreferenceDataset:
        return PreferenceDataset(super()._dataset(records, images, video_folder), self.precomputed)

    def _shard_dataset(self, spec: str) -> Any:
        raise ConfigError(f"model.data.data_path={spec!r}: a preference stage reads JSON / JSONL records, not shards")
