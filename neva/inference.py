"""Answering prompts about images with a neva checkpoint: the one front end of ``neva.generate`` and ``neva.evaluate``.

``Answerer`` loads a checkpoint's model, tokenizer and metadata, picks the prompt format and completes the decoding
settings with what the checkpoint decides (EOS and end-of-turn stops, padding); its ``answer`` turns a batch of
``(prompt, images)`` items into answer texts. ``read_jsonl`` and ``record_image_paths`` read the JSONL files both CLIs
take.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from neva.checkpoint.neva_format import load_metadata, load_model, load_tokenizer
from neva.checkpoint.step import as_neva_checkpoint
from neva.constants import IGNORE_INDEX, IMAGE_TOKEN, VIDEO_TOKEN
from neva.data.encoding import encode, tokenize_text
from neva.data.front_ends import front_end_for
from neva.data.images import ImageProcessor, decode_image, read_regular_file
from neva.data.qwen_images import QwenImageSpec, image_patches, video_patches
from neva.data.raw_prompts import raw_prompt_ids
from neva.data.records import record_images
from neva.data.templates.base import Message, end_of_turn_ids, stop_strings
from neva.data.templates.chat_template import ChatTemplateRenderer
from neva.data.templates.registry import DEFAULT_TEMPLATE, TEMPLATE_CLASSES, get_template, raw_image_text
from neva.data.video import read_video_file
from neva.data.video_decode import VideoLimits
from neva.models.config import NevaConfig
from neva.models.generation import GenerationConfig, generate, left_pad
from neva.models.loss import token_cross_entropy
from neva.models.media import image_media
from neva.models.mrope import HF_TOKENS_PER_SECOND, mrope_positions

ImageInput = Image.Image | str | os.PathLike
"""An image given as a PIL image or as a path to open."""

Item = tuple[str, Sequence[ImageInput]] | tuple[str, Sequence[ImageInput], Sequence[Any]]
"""A user prompt and its images, in the order of their ``<image>`` tags; optionally its videos, in the order of their
``<video>`` tags, each a video's sampled frames: a uint8 ``[F, H, W, 3]`` array or tensor (RGB, what a decoder gives),
each frame processed as the tower's images are."""


class Prepared(NamedTuple):
    """One item ready to generate from: token ids, the tower inputs (uint8 ``[N, 3, H, W]``, AnyRes tiles, or a
    native tower's flattened patches), for an AnyRes model each image's ``(height, width)``, the videos' frames, and
    for a native-resolution model each image's patch grid and the prompt's M-RoPE positions ``[3, len]``."""

    ids: list[int]
    pixels: torch.Tensor | None
    sizes: list[tuple[int, int]] | None
    frames: torch.Tensor | None
    grid: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    video_grid: torch.Tensor | None = (
        None  # a native tower's [V, 3] temporal-patch grid per video (``frames``: patches)
    )


class PromptBuilder:
    """Turns a user prompt + its images into token ids (image positions expanded) for one checkpoint.

    ``template`` None means raw mode: the prompt is used as given and tokenized as HF's ``LlavaProcessor`` does.
    """

    def __init__(
        self,
        tokenizer: Any,
        cfg: NevaConfig,
        template: str | None,
        system: str | None = None,
        use_chat_template: bool = True,
        tokenization: str = "neva",
        raw_image_block: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.system = system
        self.tokenization = tokenization
        self.template = None if template is None else get_template(template, tokenizer, use_chat_template)
        # Raw mode: what an <image> tag becomes, its one image token expanded (the family's processor's sequence,
        # e.g. Gemma 3's ``\n\n<start_of_image>`` … ``<end_of_image>\n\n``, InternVL's ``<img>`` … ``</img>``);
        # None: the tag (LLaVA's) or, for a template with ``raw_blocks``, its vision block (``neva.data.raw_prompts``).
        self.raw_image_block = raw_image_block

    def ids(
        self,
        prompt: str,
        num_images: int,
        image_tokens: Sequence[int] | None = None,
        video_tokens: Sequence[int] = (),
    ) -> list[int]:
        """Token ids of the full model input; ``image_tokens``: each image's positions (AnyRes), else
        ``num_image_tokens`` each; ``video_tokens``: each video's positions (``NevaConfig.video_tokens``), in the
        order of the ``<video>`` tags, each tag written as the model's ``video_token``.

        Raises:
            ValueError: the number of ``<image>`` (``<video>``) tags differs from the number of images (videos).
        """
        images = iter(image_tokens if image_tokens is not None else [self.cfg.num_image_tokens] * num_images)
        videos = iter(video_tokens)
        video_tag = self.tokenizer.convert_ids_to_tokens(self.cfg.video_token) if video_tokens else VIDEO_TOKEN
        if self.template is None:
            # the family's HF processor: its placeholders expanded, one tokenizer call (neva.data.raw_prompts)
            return raw_prompt_ids(
                self.tokenizer,
                prompt,
                self.cfg.image_token_id,
                images,
                videos,
                num_images,
                len(video_tokens),
                video_tag,
                self.raw_image_block,
            )
        prompt = self._tagged(prompt, num_images)
        if video_tokens and VIDEO_TOKEN not in prompt:
            prompt = (VIDEO_TOKEN + "\n") * len(video_tokens) + prompt
        self._check_tags(prompt, num_images, len(video_tokens))
        # Each position's count in tag order (a video tag may be written as the image token: the order tells them).
        counts = iter([next(images) if t == IMAGE_TOKEN else next(videos) for t in re.findall(_TAGS, prompt)])
        video_tag = self.template.video_block or video_tag  # Qwen-VL: the video's vision block
        text = self.template.render_prompt([Message("user", prompt.replace(VIDEO_TOKEN, video_tag))],
                                           system_prompt=self.system)  # fmt: skip
        # Same tokenization as training (neva.data.encoding, the checkpoint's tokenization), then expand media.
        add_special = not isinstance(self.template, ChatTemplateRenderer)
        ids, _ = tokenize_text(text, self.tokenizer, add_special, self.cfg.image_token_id, self.tokenization)
        media = {self.cfg.image_token_id, self.cfg.video_token} if video_tokens else {self.cfg.image_token_id}
        out: list[int] = []
        for tok in ids:
            out += [tok] * next(counts) if tok in media else [tok]
        return out

    def labelled_ids(self, prompt: str, reply: str, num_images: int) -> tuple[list[int], list[int]]:
        """Token ids and labels of the exchange ``prompt`` → ``reply``, rendered and encoded by training's rules (this
        template, system prompt and tokenization; ``neva.data.encoding.encode``): what a held-out sample's loss is
        computed on. Images take ``num_image_tokens`` positions each.

        Raises:
            ValueError: raw mode (no template says where a reply starts), or tags that do not match ``num_images``.
        """
        if self.template is None:
            raise ValueError("scoring a reply needs a conversation template; raw prompts have no reply format")
        prompt = self._tagged(prompt, num_images)
        self._check_tags(prompt, num_images)
        messages = [Message("user", prompt), Message("assistant", reply)]
        rendered = self.template.render(messages, system_prompt=self.system)
        enc = encode(
            rendered, self.tokenizer, self.cfg.image_token_id, self.cfg.num_image_tokens, num_images,
            tokenization=self.tokenization,
        )  # fmt: skip
        return enc.input_ids, enc.labels

    @staticmethod
    def _tagged(prompt: str, num_images: int) -> str:
        """The prompt with one ``<image>`` line per image in front when it has no tag (how training data places
        them; ``neva.data.conversation.place_image_tags``)."""
        return (IMAGE_TOKEN + "\n") * num_images + prompt if num_images and IMAGE_TOKEN not in prompt else prompt

    @staticmethod
    def _check_tags(prompt: str, num_images: int, num_videos: int = 0) -> None:
        for tag, given, what in ((IMAGE_TOKEN, num_images, "image"), (VIDEO_TOKEN, num_videos, "video")):
            tags = prompt.count(tag)
            if tags != given:
                raise ValueError(f"prompt has {tags} {tag} tag(s) but {given} {what}(s) were given")

    def stop_strings(self) -> tuple[str, ...]:
        """The template's end-of-turn text (e.g. ``<|im_end|>``, plain's newline)."""
        return stop_strings(self.template)

    def eos_ids(self) -> tuple[int, ...]:
        """EOS, plus the end-of-turn token when the template's end-of-turn text is one token."""
        return end_of_turn_ids(self.template, self.tokenizer)

    def pad_id(self) -> int:
        """The id fed as left padding: the tokenizer's pad token, unless missing or ``<image>`` (then 0)."""
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None or pad == self.cfg.image_token_id else pad


_TAGS = f"{re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)}"


def load_images(images: Sequence[ImageInput], processor: Any) -> list[Image.Image]:
    """Images (PIL or paths) decoded by the training loader's rules (regular files only, the pixel cap checked before
    decoding).

    Raises:
        ValueError: images for a checkpoint without a vision tower (``processor`` None).
    """
    if images and processor is None:
        raise ValueError("this checkpoint has no vision tower; drop the images")
    return [
        image if isinstance(image, Image.Image) else decode_image(read_regular_file(str(image), str(image)), str(image))
        for image in images
    ]


def load_pixels(images: Sequence[ImageInput], processor: Any) -> torch.Tensor | None:
    """Images → uint8 ``[N, 3, H, W]`` with neva's preprocessing (the model normalises them), AnyRes: every image's
    tiles; None for no images."""
    loaded = load_images(images, processor)
    if not loaded:
        return None
    if getattr(processor, "variable_tokens", False):
        return processor.tiles(loaded)
    return torch.stack([processor(image) for image in loaded])


def decode_answer(tokenizer: Any, ids: list[int], stops: Sequence[str]) -> str:
    """Generated ids → text without special tokens, cut at the first stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


class Answerer:
    """One checkpoint ready to answer ``(prompt, images)`` items.

    Args:
        checkpoint: a neva checkpoint directory.
        decoding: sampling settings and ``max_new_tokens``; its ``stop_strings`` are extra stops. Its
            ``eos_token_ids`` and ``pad_token_id`` are replaced by the checkpoint's, and the template's end-of-turn
            text is put in front of its stops; ``self.generation`` holds the result.
        template: conversation template; None = the checkpoint's ``conv_template`` metadata, else
            ``DEFAULT_TEMPLATE``.
        raw: use prompts as given (HF ``LlavaProcessor`` tokenization) instead of a template.
        system: system prompt (template mode); None = the one the checkpoint was trained with (its
            ``system_prompt`` metadata), else the template's default.
        aspect_ratio: ``square``, ``pad`` or ``keep``; None = the checkpoint's ``image_aspect_ratio`` (else square).
        device: where the model runs.
        dtype: parameter dtype; None = the dtype the checkpoint was saved in.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        decoding: GenerationConfig,
        *,
        template: str | None = None,
        raw: bool = False,
        system: str | None = None,
        aspect_ratio: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        with as_neva_checkpoint(checkpoint) as directory:  # a run's step checkpoint: merged into a neva one first
            meta = load_metadata(directory)
            model = load_model(directory, device=device, dtype=dtype)
            tokenizer = load_tokenizer(directory)
        self._serve(model, tokenizer, meta, decoding, template, raw, system, aspect_ratio)

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, meta: dict[str, Any], decoding: GenerationConfig) -> Answerer:
        """An answerer of a model already in memory (the training model during training, ``meta``: the run's
        ``run_metadata``), served as a checkpoint of it with that metadata would be. ``model``: what ``generate``
        takes (``neva.parallel.generation_model.LayoutGenerationModel`` for a parallelized training model)."""
        answerer = cls.__new__(cls)
        answerer._serve(model, tokenizer, meta, decoding, None, False, None, None)
        return answerer

    def _serve(
        self,
        model: Any,
        tokenizer: Any,
        meta: dict[str, Any],
        decoding: GenerationConfig,
        template: str | None,
        raw: bool,
        system: str | None,
        aspect_ratio: str | None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        trained = meta.get("conv_template") or DEFAULT_TEMPLATE
        template = None if raw else (template or trained)
        # Served as trained: the run's system prompt and its choice of the tokenizer's chat template.
        system = system if system is not None else meta.get("system_prompt")
        use_chat = bool(meta.get("use_chat_template", True))
        tokenization = meta.get("tokenization", "neva")  # checkpoints before the key: one tokenizer call
        # A raw prompt's images as the checkpoint's family writes them (its trained template's image block: Gemma 3's,
        # InternVL's), whatever template serves it; a template with ``raw_blocks`` is neva.data.raw_prompts' own.
        block = raw_image_text(trained)[0] if raw else IMAGE_TOKEN
        self.builder = PromptBuilder(
            self.tokenizer,
            self.model.cfg,
            template,
            system,
            use_chat,
            tokenization,
            raw_image_block=None if block == IMAGE_TOKEN or TEMPLATE_CLASSES[trained].raw_blocks else block,
        )
        vision = self.model.cfg.vision
        aspect_ratio = aspect_ratio or meta.get("image_aspect_ratio", "square")
        # The model's front end, as training chose it; a model that lays out AnyRes tiles has its images tiled, always.
        tiled = "anyres" if self.model.cfg.anyres is not None else aspect_ratio
        min_pixels, max_pixels = meta.get("min_pixels"), meta.get("max_pixels")  # a native tower's budget as trained
        self.processor = front_end_for(vision, self.model.cfg, tiled, min_pixels, max_pixels).processor
        # Video frames: each processed as the tower's images are (one tile, the tower's square fit)
        self.frame_processor = ImageProcessor(vision) if self.model.cfg.video is not None else None
        # ...sampled as the run sampled them (checkpoints before these keys: the data defaults)
        defaults = VideoLimits()
        self.video_limits = VideoLimits(meta.get("num_frames", defaults.num_frames), meta.get("video_fps"))
        self.generation = dataclasses.replace(
            decoding,
            eos_token_ids=self.builder.eos_ids(),
            stop_strings=self.builder.stop_strings() + tuple(decoding.stop_strings),
            pad_token_id=self.builder.pad_id(),
        )

    def prepare(self, item: Item) -> Prepared:
        """One item's token ids, pixels, for an AnyRes model each image's ``(height, width)`` (else None), its
        videos' processed frames ``[F, 3, H, W]`` uint8 (None without videos) and a native model's grids and
        positions (``Prepared``).

        Raises:
            ValueError: a prompt that is not a string, whose ``<image>`` / ``<video>`` tags do not match its images /
                videos, or that fills the model's context; images for a text-only model, videos for a model without
                video, a video that is not ``[F, H, W, 3]`` uint8 frames.
            OSError, PIL.Image.DecompressionBombError: an image that cannot be read.
        """
        prompt, images, *rest = item
        videos = rest[0] if rest else ()
        if not isinstance(prompt, str):
            raise ValueError(f"no prompt: expected a string, got {type(prompt).__name__}")
        loaded = load_images(images, self.processor)
        if isinstance(self.processor, QwenImageSpec):
            return self._prepare_native(prompt, loaded, videos)
        if hasattr(self.processor, "layout_ids"):  # a patch-grid front end that lays out its image text (Pixtral's)
            return self._prepare_laid_out(prompt, loaded, videos)
        frames = [self._frames(v) for v in videos]
        cfg = self.model.cfg
        sizes = self.processor.sizes(loaded) if cfg.anyres is not None else None
        image_tokens = None if sizes is None else [cfg.image_tokens(s) for s in sizes]
        if hasattr(self.processor, "tokens_of"):  # a tiling front end (InternVL's): each image's tiles' positions
            image_tokens = self.processor.tokens_of(loaded)
        ids = self.builder.ids(prompt, len(images), image_tokens, [cfg.video_tokens(len(f)) for f in frames])
        self._check_context(ids)
        return Prepared(ids, load_pixels(loaded, self.processor), sizes, torch.cat(frames) if frames else None)

    def _prepare_native(self, prompt: str, loaded: list[Image.Image], videos: Sequence[Any]) -> Prepared:
        """A native-resolution model's item: each image at its own grid (the run's pixel budget), each video's frames
        as temporal patches (``video_patches``), their positions t·h·w / merge², the prompt's M-RoPE positions by the
        rule training used (``neva.models.mrope``). A served video's frames carry no timing: Qwen2.5-VL's temporal
        positions take transformers' default of one second per grid."""
        cfg, spec = self.model.cfg, self.processor
        if videos and not (cfg.patch_video and cfg.vision.spec.video.served):
            raise ValueError(
                f"this checkpoint ({cfg.vision.kind}, video_token_id {cfg.video_token_id}) serves no video"
            )
        processed = [image_patches(image, spec) for image in loaded]
        clips = [video_patches([Image.fromarray(f) for f in _frame_array(v)], spec) for v in videos]
        grid = torch.cat([g for _, g in processed]) if processed else None
        video_grid = torch.cat([g for _, g in clips]) if clips else None
        tokens = [] if grid is None else (grid.prod(-1) // spec.merge_size**2).tolist()
        video_tokens = [] if video_grid is None else (video_grid.prod(-1) // spec.merge_size**2).tolist()
        ids = self.builder.ids(prompt, len(loaded), tokens, video_tokens)
        self._check_context(ids)
        positions, _ = mrope_positions(
            torch.tensor(ids), grid, video_grid, spatial_merge_size=spec.merge_size,
            image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id if cfg.patch_video else -1,
            family=cfg.vision.kind, tokens_per_second=cfg.vision.tokens_per_second or HF_TOKENS_PER_SECOND,
        )  # fmt: skip
        pixels = torch.cat([p for p, _ in processed]) if processed else None
        video_pixels = torch.cat([p for p, _ in clips]) if clips else None
        return Prepared(ids, pixels, None, video_pixels, grid, positions, video_grid)

    def _prepare_laid_out(self, prompt: str, loaded: list[Image.Image], videos: Sequence[Any]) -> Prepared:
        """An item of a patch-grid model whose images' text is more than their image tokens (Pixtral's rows closed by
        ``[IMG_BREAK]`` / ``[IMG_END]``): each image's span expanded as any image's, then laid out by its front end,
        as training's data path does (``neva.data.pixtral_images``)."""
        if videos:
            raise ValueError(f"this checkpoint ({self.model.cfg.vision.kind}) serves no video")
        pixels, grid = self.processor.patch_images(loaded)
        ids = self.builder.ids(prompt, len(loaded), self.processor.tokens_of(loaded))
        ids = self.processor.layout_ids(ids, grid, self.model.cfg)
        self._check_context(ids)
        return Prepared(ids, pixels if loaded else None, None, None, grid if loaded else None)

    def _check_context(self, ids: list[int]) -> None:
        context = self.model.cfg.llm.max_seq_len
        if len(ids) >= context:
            raise ValueError(f"the prompt is {len(ids)} tokens, which fills the model's context of {context}")

    def read_video(self, path: str | os.PathLike) -> np.ndarray:
        """A video file's frames for an item (uint8 ``[F, H, W, 3]``), sampled as the checkpoint's run sampled them
        (``num_frames``, ``video_fps``). Raises ``neva.data.video_decode.VideoError``."""
        return read_video_file(path, self.video_limits)

    def _frames(self, video: Any) -> torch.Tensor:
        """A video's ``[F, H, W, 3]`` uint8 frames → ``[F, 3, s, s]`` uint8, each frame as the tower's images."""
        if self.frame_processor is None:
            raise ValueError("this checkpoint takes no video (its model has no video config)")
        return torch.stack([self.frame_processor(Image.fromarray(frame)) for frame in _frame_array(video)])

    def answer(self, items: Sequence[Item]) -> list[str]:
        """Answer ``items`` as one left-padded batch: texts without special tokens, cut at the first stop string.

        Raises:
            ValueError, OSError: an item ``prepare`` refuses.
        """
        return self._generate([self.prepare(item) for item in items])

    def _generate(self, prepared: list[Prepared]) -> list[str]:
        return [decode_answer(self.tokenizer, ids, self.generation.stop_strings) for ids in self.generate_ids(prepared)]

    def generate_ids(self, prepared: list[Prepared]) -> list[list[int]]:
        """The new token ids of each prepared item, generated as one left-padded batch."""
        pixels = [p.pixels for p in prepared if p.pixels is not None]
        frames = [p.frames for p in prepared if p.frames is not None]
        grids = [p.grid for p in prepared if p.grid is not None]
        video_grids = [p.video_grid for p in prepared if p.video_grid is not None]
        anyres = self.model.cfg.anyres is not None
        counts = [
            len(p.sizes) if anyres else len(p.grid) if p.grid is not None else 0 if p.pixels is None else len(p.pixels)
            for p in prepared
        ]
        sizes = [size for p in prepared for size in p.sizes] if anyres else None
        native = any(p.positions is not None for p in prepared)
        # Stop strings are looked for in the text with special tokens kept, as HF's StopStringCriteria sees tokens.
        return generate(
            self.model, [p.ids for p in prepared], torch.cat(pixels) if pixels else None, counts,
            self.generation, decode=self.tokenizer.decode, image_sizes=sizes,
            video_pixel_values=torch.cat(frames) if frames else None,
            image_grid=torch.cat(grids) if grids else None,
            video_grid=torch.cat(video_grids) if video_grids else None,
            position_ids=[p.positions for p in prepared] if native else None,
        )  # fmt: skip

    @torch.no_grad()
    def reply_losses(self, scored: Sequence[tuple[str, Sequence[ImageInput], str]]) -> list[float]:
        """Each ``(prompt, images, reply)``'s teacher-forced loss: the summed next-token cross-entropy (nats) of the
        reply's learned tokens (``PromptBuilder.labelled_ids``), one batch. A held-out sample's share of a
        validation loss, which keeps moving after exact-match accuracy has reached 1.

        Raises:
            ValueError: an AnyRes model (its images take their own positions), raw mode, tags that do not match.
        """
        if self.model.cfg.anyres is not None:
            raise ValueError("reply losses take fixed-size images; this checkpoint tiles them (AnyRes)")
        encoded = [self.builder.labelled_ids(prompt, reply, len(images)) for prompt, images, reply in scored]
        pixels = [p for _, images, _ in scored if (p := load_pixels(images, self.processor)) is not None]
        device = next(self.model.parameters()).device
        batch = left_pad([ids for ids, _ in encoded], 0, self.builder.pad_id(), device)
        labels = torch.full_like(batch.input_ids, IGNORE_INDEX)
        for row, (_, row_labels) in enumerate(encoded):
            labels[row, labels.shape[1] - len(row_labels) :] = torch.as_tensor(row_labels)
        counts = torch.tensor([len(images) for _, images, _ in scored], device=device)
        media = image_media(torch.cat(pixels).to(device), counts) if pixels else None
        logits = self.model(batch.input_ids, media, position_ids=batch.position_ids, segment_ids=batch.segment_ids)
        return [
            float(token_cross_entropy(logits[row : row + 1], labels[row : row + 1])[0]) for row in range(len(scored))
        ]

    def answer_all(
        self, items: Iterable[Item | Exception], batch_size: int, keep_going: bool = False, stand_in: Item | None = None
    ) -> Iterator[str | Exception]:
        """Answers in item order, generated ``batch_size`` items at a time (each batch as soon as it is done).

        With ``keep_going``, an item that ``prepare`` refuses yields its exception in place of an answer and the rest
        of its batch is answered; an exception given as an item (a record that could not be read) is yielded back.
        ``stand_in``: generated (its answer dropped) for a batch whose every item is refused, so that each batch
        makes one ``generate`` call: lockstep peers (``GenerationConfig.lockstep``) run the same forwards.

        Raises:
            ValueError: ``batch_size`` < 1; without ``keep_going``, the first refused item.
        """
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        items = iter(items)
        while batch := list(islice(items, batch_size)):
            results: list[Any] = []
            for item in batch:
                try:
                    if isinstance(item, Exception):
                        raise item
                    results.append(self.prepare(item))
                except (ValueError, OSError, Image.DecompressionBombError) as err:
                    if not keep_going:
                        raise
                    results.append(err)
            prepared = [r for r in results if not isinstance(r, Exception)]
            if not prepared and stand_in is not None:
                self._generate([self.prepare(stand_in)])
            answers = iter(self._generate(prepared) if prepared else [])
            yield from (r if isinstance(r, Exception) else next(answers) for r in results)


def read_jsonl(path: str | os.PathLike, keep_going: bool = False) -> list[Any]:
    """The JSONL file's records (blank lines skipped).

    Raises:
        ValueError: a line that is not JSON, naming it; with ``keep_going`` that error takes the line's place instead.
    """
    records: list[Any] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                error = ValueError(f"{path}:{number} is not JSON ({err})")
                if not keep_going:
                    raise error from err
                records.append(error)
    return records


def record_image_paths(record: dict[str, Any], root: Path) -> list[Path]:
    """A record's image paths (``image``: one path or a list, as in training records), relative to ``root``."""
    return [root / name for name in record_images(record)]


def _frame_array(video: Any) -> np.ndarray:
    """A served video's frames, checked: uint8 ``[F, H, W, 3]`` RGB."""
    array = np.asarray(video)
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or len(array) == 0:
        raise ValueError(f"a video is uint8 [frames, height, width, 3] RGB frames, got {array.dtype} {array.shape}")
    return array
