"""The online RL stage's prompts: a record with a checkable answer → a prompt sample the rollouts complete.

Two record formats, JSON or JSONL (``neva.data.records.load_records``), or shards:

- LLaVA-style: ``id``, ``image`` (a name, a list, or none), ``problem`` (or ``prompt`` as a string; ``<image>`` tags
  where the images go, else one tag per image before the text), ``answer``;
- TRL's: ``prompt`` a message list (``role`` / ``content``; content a string or TRL's parts ``{"type": "image"}`` /
  ``{"type": "text", ...}``), ``images`` the image names, ``solution``.

The prompt is encoded by the finetuning path (``neva.data.dataset.process_record``: the run's template, exact masks)
as a conversation of the prompt's turns and the gold answer as the reply: the prompt sample is that encoding up to
the reply's first learned token (the template's assistant header included), so a completion continues it exactly as
finetuning's replies did. Bad records are counted skips, one reason each (``BAD_PROMPTS``). A collated micro-batch is
its prompt samples (``prompts``) and their records (``records``: what the rewards read), with the usual skip fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Dataset

from neva.constants import IGNORE_INDEX, IMAGE_TOKEN
from neva.data.collate import collate_padded
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule, pad_token_id
from neva.data.dataset import ConversationDataset, SkipLogger, is_skipped, process_record, skip_marker
from neva.data.errors import SampleError
from neva.data.micro_batch import MicroBatch, PromptRows
from neva.data.preference import _messages
from neva.data.records import ERROR_KEY, approx_length, record_images
from neva.errors import ConfigError
from neva.models.media import Media

BAD_PROMPTS = {
    "no_answer": "a prompt record without an answer / solution: no reward can check its completions",
    "malformed_prompt": "problem / prompt missing or of the wrong type",
}
ANSWER_KEYS = ("answer", "solution")


class PromptError(SampleError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail or BAD_PROMPTS[reason])


def prompt_conversation(record: dict[str, Any]) -> dict[str, Any]:
    """The LLaVA record (prompt turns, the gold answer as the reply) of a prompt record.

    Raises:
        SampleError: a ``BAD_PROMPTS`` reason, or the record's own read error.
    """
    if ERROR_KEY in record:
        raise SampleError(record[ERROR_KEY], record.get("detail", ""))
    answer = next((record[k] for k in ANSWER_KEYS if record.get(k) is not None), None)
    if answer is None or not str(answer).strip():
        raise PromptError("no_answer")
    prompt = record.get("problem", record.get("prompt"))
    if prompt is None:
        raise PromptError("malformed_prompt", f"keys {sorted(record)}")
    try:
        turns = _messages(prompt, "user")
    except SampleError as err:
        raise PromptError("malformed_prompt", err.detail) from err
    images = record_images(record)
    tags = sum(t["content"].count(IMAGE_TOKEN) for t in turns)
    if images and not tags:  # LLaVA-style problems often leave the image's place to the trainer
        turns[0] = {**turns[0], "content": "\n".join([IMAGE_TOKEN] * len(images) + [turns[0]["content"]])}
    base = {"id": record.get("id"), **({"image": images} if images else {})}
    return {**base, "conversations": [*turns, {"role": "assistant", "content": str(answer)}]}


def prompt_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A finetuning sample cut before its reply: ids (and a native-resolution model's M-RoPE positions) up to the
    first learned label, nothing learned."""
    learned = (sample["labels"] != IGNORE_INDEX).nonzero().flatten()
    end = int(learned[0]) if learned.numel() else sample["input_ids"].numel()
    out = {**sample, "input_ids": sample["input_ids"][:end], "labels": torch.full((end,), IGNORE_INDEX)}
    if "position_ids" in sample:
        out["position_ids"] = sample["position_ids"][..., :end]
    return out


def completion_sample(prompt: dict[str, Any], completion: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """A prompt sample with a completion appended (``labels`` its learned ids): the row the update trains on. Where
    the prompt brings its own positions (M-RoPE), the completion's text continues from the prompt's largest position
    + 1 on every axis, as generation placed it (``neva.models.generation``) and as the data path places text after
    an image (``neva.models.mrope``)."""
    row = {**prompt, "input_ids": torch.cat([prompt["input_ids"], completion]),
           "labels": torch.cat([prompt["labels"], labels])}  # fmt: skip
    if "position_ids" in prompt:
        own = prompt["position_ids"]
        after = own.amax() + 1 + torch.arange(completion.numel(), dtype=own.dtype)
        row["position_ids"] = torch.cat([own, after.expand(own.shape[0], -1)], dim=-1)
    return row


class PromptDataset(Dataset):
    """Prompt samples over a ``ConversationDataset``'s encoder and image sources (the finetuning path's pieces): an
    item is the prompt sample with its ``record``, or a skip marker."""

    def __init__(self, conversations: ConversationDataset) -> None:
        self.base = conversations
        self._log = SkipLogger()

    def __len__(self) -> int:
        return len(self.base.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.base.records[index]
        rid = record.get("id") if isinstance(record, dict) else None
        try:
            if not isinstance(record, dict):
                raise PromptError("malformed_prompt", f"record {record!r:.80}")
            b = self.base
            sample = process_record(
                prompt_conversation(record), b.settings, b.image_source, b.front_end, b.video_source
            )
        except SampleError as exc:
            sample = skip_marker(rid, exc.reason, exc.detail)
        if is_skipped(sample):
            self._log(sample)
            return sample
        return {**prompt_sample(sample), "record": record}

    def modality_lengths(self) -> list[int]:
        s = self.base.settings
        out = []
        for record in self.base.records:
            try:
                out.append(approx_length(prompt_conversation(record), s.num_image_tokens))
            except (SampleError, AttributeError, TypeError):
                out.append(1)
        return out


class PromptCollator:
    """Prompt samples → ``collate_padded``'s micro-batch (its counts: the skip accounting's) whose ``stage`` holds the
    prompt samples and their records (``PromptRows``; the rows are built later, prompt + completion, by the stage's
    step)."""

    def __init__(self, pad_id: int, seq_length: int, pad_to_multiple_of: int = 64) -> None:
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, batch: list[dict[str, Any]]) -> MicroBatch:
        out = collate_padded(batch, self.pad_id, self.pad_to_multiple_of, self.seq_length)
        good = [s for s in batch if not is_skipped(s)]
        prompts = [{k: v for k, v in s.items() if k != "record"} for s in good]
        return out.with_(stage=PromptRows(prompts=prompts, records=[s["record"] for s in good]))


class PromptDataModule(NevaDataModule):
    """``NevaDataModule`` whose datasets are prompt records and whose batches are prompt samples (never packed)."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, model_config: Any = None, **kwargs: Any) -> None:
        super().__init__(cfg, tokenizer, model_config, **kwargs)
        self.collator = PromptCollator(pad_token_id(tokenizer), self.seq_length, cfg.pad_to_multiple_of)

    def _dataset(
        self, records: list[dict[str, Any]], images: Callable[[int, int], Any] | None, video_folder: str | None = None
    ) -> PromptDataset:
        return PromptDataset(super()._dataset(records, images, video_folder))

    def _shard_dataset(self, spec: str) -> Any:
        raise ConfigError(f"model.data.data_path={spec!r}: the online RL stage reads JSON / JSONL prompt records")


def collate_groups(
    rows: list[dict[str, Any]], group: int, pad_id: int, pad_to_multiple_of: int, seq_length: int | None = None
) -> MicroBatch:
    """A micro-batch's rows (``group`` consecutive rows per prompt: its completions) collated as the update runs them,
    each prompt's images encoded once for its group (``group_media``)."""
    batch = collate_padded(rows, pad_id, pad_to_multiple_of, seq_length)
    if batch.media is not None:
        firsts = collate_padded(rows[::group], pad_id, pad_to_multiple_of, seq_length)
        batch = batch.with_(media=group_media(batch.media, firsts.media, group))
    return batch


def group_media(rows: Media, firsts: Media, group: int) -> Media:
    """``rows`` (the media of a micro-batch's completions, ``group`` consecutive rows per prompt) with each prompt's items
    encoded once: the tower inputs of each group's first row only, whose features the group's other rows read again
    (``MediaInputs.feature_rows``), as the preference stage's pairs do. A group's rows share the prompt, and with it
    every item's columns (a placeholder never sits in a completion: the rollouts suppress it); a modality whose
    positions are not the first rows' repeated keeps every row's inputs."""
    out = {}
    for modality, inputs in rows.items():
        once = getattr(firsts, modality)
        if inputs is not None and once is not None and once.positions is not None:
            per_prompt = torch.bincount(once.positions[:, 0], minlength=int(once.positions[:, 0].max()) + 1)
            starts = torch.cumsum(per_prompt, 0) - per_prompt
            feature_rows = torch.cat([starts[i] + torch.arange(int(n)) for i, n in enumerate(per_prompt)
                                      for _ in range(group)]) if len(per_prompt) else torch.zeros(0, dtype=torch.long)  # fmt: skip
            expected = torch.cat([torch.stack([torch.full((int(n),), i * group + j), once.positions[starts[i] : starts[i] + n, 1]], 1)
                                  for i, n in enumerate(per_prompt) for j in range(group)])  # fmt: skip
            if torch.equal(expected, inputs.positions):
                inputs = replace(once, positions=inputs.positions, items_per_row=inputs.items_per_row,
                                 tokens=inputs.tokens, feature_rows=feature_rows)  # fmt: skip
        out[modality] = inputs
    return Media(**out)
