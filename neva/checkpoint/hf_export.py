"""A neva checkpoint → a llava-hf directory (current key layout), streaming: weights, the wrapper's config
(``hf_wrappers``), generation config, and with a tokenizer the processor files (``hf_processors``) and the chat
template neva trained with (``hf_files``)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import llava_config_dict
from neva.checkpoint.hf_files import (
    export_chat_template,
    export_dtype,
    generation_eos_ids,
    make_transformers_4_readable,
    template_settings,
    write_chat_template_files,
)
from neva.checkpoint.hf_keys import neva_key_to_hf
from neva.checkpoint.hf_moe import per_expert_tensors
from neva.checkpoint.hf_processors import save_processor, tower_image_processor
from neva.checkpoint.hf_read import GROWN_KEYS, cast_floating, grow_rows, has_tokenizer
from neva.checkpoint.hf_wrappers import wrapper_for
from neva.checkpoint.neva_format import (
    TIED_HEAD_KEY,
    TensorSource,
    iter_tensors,
    load_config,
    load_metadata,
    tensor_pairs,
)
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from neva.constants import IMAGE_TOKEN
from neva.data.templates.registry import image_token_for
from neva.models.anyres import parse_aspect_ratio
from neva.models.config import NevaConfig
from neva.typed import ConfigError


def save_llava_hf(
    out: str | os.PathLike,
    cfg: NevaConfig,
    tensors: TensorSource,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    template: dict[str, Any] | None = None,
) -> Path:
    """Write a llava-hf directory (current key layout) from neva tensors, streaming.

    Writes ``config.json`` (``LlavaConfig``, or the model's other wrapper: ``hf_wrappers``), ``generation_config.json``,
    safetensors weights and, with a tokenizer, the tokenizer files plus a ``LlavaProcessor`` / ``CLIPImageProcessor``
    config (``hf_processors``), so that ``LlavaForConditionalGeneration``, ``AutoTokenizer`` and ``AutoProcessor``
    load the directory under transformers 4.4x and 5.x (``hf_files``). With a tokenizer, the chat template renders as
    neva trained (``template`` settings, default ``vicuna_v1``) and ``generation_config.json`` stops at the template's
    end of turn. LoRA must be merged into ``tensors`` before (a plain neva state dict is expected).

    Args:
        out: directory to create.
        cfg: model config (needs a vision tower and an ``mlp2x_gelu`` projector).
        tensors: neva state dict or ``(key, tensor)`` iterator.
        tokenizer: HF tokenizer (or None: weights and configs only).
        dtype: cast floating tensors to this dtype; None keeps them.
        max_shard_bytes: shard size limit.
        overwrite: replace an existing ``out``.
        template: ``hf_files.template_settings`` of the checkpoint (None: ``vicuna_v1``, its default system prompt).

    Returns:
        ``out``.
    """
    import transformers

    template = template or template_settings({})
    pad_id = getattr(tokenizer, "pad_token_id", None)
    config_kw = llava_config_dict(cfg, pad_token_id=pad_id)
    wrapper = wrapper_for(cfg)
    if tokenizer is not None:
        config_kw["text_config"].update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with atomic_directory(out, overwrite) as tmp:
        dtypes: set[torch.dtype] = set()

        def hf_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for key, tensor in tensor_pairs(tensors):
                if key == TIED_HEAD_KEY and cfg.llm.tie_word_embeddings:
                    continue
                tensor = cast_floating(tensor, dtype)
                if tensor.is_floating_point():
                    dtypes.add(tensor.dtype)
                yield from per_expert_tensors(neva_key_to_hf(key), tensor)

        write_safetensors(tmp, hf_tensors(), max_shard_bytes)
        config = getattr(transformers, wrapper.config_class)(**config_kw)
        config.architectures = [wrapper.model_class]
        if len(dtypes) == 1:
            config.dtype = next(iter(dtypes))
        config.save_pretrained(str(tmp))
        text = config_kw["text_config"]
        eos = text.get("eos_token_id") if tokenizer is None else generation_eos_ids(template, tokenizer)
        transformers.GenerationConfig(
            bos_token_id=text.get("bos_token_id"), eos_token_id=eos, pad_token_id=pad_id
        ).save_pretrained(str(tmp))
        if tokenizer is not None:
            chat_template = export_chat_template(template, tokenizer)
            save_processor(tmp, cfg, tokenizer, chat_template)
            write_chat_template_files(tmp, chat_template)
        make_transformers_4_readable(tmp, cfg, config.dtype if len(dtypes) == 1 else None)
    return Path(out)


def _with_image_row(
    cfg: NevaConfig, tensors: Iterator[tuple[str, torch.Tensor]]
) -> tuple[NevaConfig, Iterator[tuple[str, torch.Tensor]]]:
    """``cfg`` and ``tensors`` with one more vocabulary row, the image token's, set to the mean of the others."""
    grown = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, vocab_size=cfg.llm.vocab_size + 1))
    rows = grown.llm.vocab_size
    return grown, ((k, grow_rows(t, rows) if k in GROWN_KEYS else t) for k, t in tensors)


def export_llava(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    conv_template: str | None = None,
) -> Path:
    """Convert a neva checkpoint directory to a llava-hf directory (see ``save_llava_hf``).

    ``dtype`` None exports in the run's half precision (``trainer.precision`` bf16 → bfloat16), else keeps the stored
    dtypes. The chat template is the one the checkpoint records (``conv_template``, ``system_prompt``,
    ``use_chat_template``), ``conv_template`` overriding the name; a checkpoint that records none exports ``vicuna_v1``
    (what ``neva.generate`` uses for it) with a warning.
    """
    ckpt = Path(ckpt)
    cfg = load_config(ckpt)
    meta = load_metadata(ckpt)
    tokenizer = None
    if has_tokenizer(ckpt):
        from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

        tokenizer = load_hf_tokenizer(ckpt)
    aspect = meta.get("image_aspect_ratio", "square")
    if aspect not in ("square", "anyres") and parse_aspect_ratio(aspect) is None:  # AnyRes: tiled as the run did
        warnings.warn(
            f"checkpoint uses image_aspect_ratio={aspect!r}; the exported "
            f"{type(tower_image_processor(cfg.vision)).__name__} does not pad as the run did",
            stacklevel=2,
        )
    if meta.get("tokenization", "neva") == "llava":
        warnings.warn(
            f"{ckpt} was trained with model.data.tokenization=llava (LLaVA's tokenizer_image_token ids); transformers' "
            "LlavaProcessor tokenizes the whole prompt once, so served prompts lack the dummy-prefix token after each "
            "image (docs/INTEROP.md); neva.generate serves this checkpoint with its trained ids",
            stacklevel=2,
        )
    template = template_settings(meta, conv_template)
    if image_token_for(template["conv_template"]) != IMAGE_TOKEN:
        raise ConfigError(
            f"conv_template {template['conv_template']!r} writes images as {image_token_for(template['conv_template'])}"
            f" blocks; a llava-hf export's image token is {IMAGE_TOKEN} (a Qwen-VL model exports as its own family)"
        )
    if tokenizer is not None and not (conv_template or meta.get("conv_template")):
        warnings.warn(
            f"{ckpt} records no conv_template; the export's chat template is {template['conv_template']} (what "
            "neva.generate uses for this checkpoint); pass --conv-template to choose another",
            stacklevel=2,
        )
    tensors: Iterator[tuple[str, torch.Tensor]] = iter_tensors(ckpt)
    if not cfg.image_token_has_row:
        # LLaVA-original imports have no <image> row (LLaVA splices at -200); llava-hf embeds image_token_index, so
        # the export appends one mean row (an extra class in the served softmax: docs/INTEROP.md).
        cfg, tensors = _with_image_row(cfg, tensors)
    return save_llava_hf(
        out,
        cfg,
        tensors,
        tokenizer,
        dtype=dtype if dtype is not None else export_dtype(meta),
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        template=template,
    )
