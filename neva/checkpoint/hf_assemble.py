"""A new model from an HF decoder (Llama, Mistral, Qwen2, Mixtral) and an HF CLIP or SigLIP tower: a neva checkpoint
with a freshly initialised projector (``import_llm_and_vision``), or their weights copied into a materialised model
(``load_hf_weights``), the tokenizer given ``<image>`` (``prepare_tokenizer``).

The tokens neva adds grow the embedding and LM head; the new rows start at the mean of the old ones, as LLaVA's do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.checkpoint.hf_keys import detect_prefixes
from neva.checkpoint.hf_read import (
    GROWN_KEYS,
    cast_floating,
    check_complete,
    grow_rows,
    hf_tensor_shapes,
    iter_hf_tensors,
    load_hf_config,
    map_keys,
    with_image_stats,
)
from neva.checkpoint.neva_format import TIED_HEAD_KEY, check_shape, save_checkpoint
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.constants import IMAGE_TOKEN
from neva.data.tokens import add_vision_tokens
from neva.hf_local import model_dir
from neva.models.config import NevaConfig, ProjectorConfig
from neva.models.projector import build_projector, init_projector


def prepare_tokenizer(llm_dir: str | os.PathLike) -> Any:
    """The HF tokenizer of ``llm_dir`` with ``<image>`` (and ``<pad>`` if it has no pad token) added as specials."""
    from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

    tokenizer = load_hf_tokenizer(llm_dir)
    add_vision_tokens(tokenizer)
    return tokenizer


@torch.no_grad()
def load_hf_weights(model: Any, llm_dir: str | os.PathLike, vision_dir: str | os.PathLike | None = None) -> None:
    """Copy an HF Llama's (and optionally an HF CLIP's) weights into a materialised neva model, tensor by tensor.

    The projector is left as it is (freshly initialised by the caller). Embedding / LM-head rows beyond the HF
    vocabulary (``<image>``, ``<pad>``, padding) are set to the mean of the HF rows.

    Args:
        model: a ``NevaModel`` (or any object with ``cfg`` and ``state_dict()`` under neva keys) on a real device.
        llm_dir: HF ``LlamaForCausalLM`` directory.
        vision_dir: HF CLIP or SigLIP directory (vision model or whole model), or None to keep the vision tower as is.

    Raises:
        ValueError: unknown HF tensors, LLM/vision tensors the directories lack, or a tensor whose shape is not the
            model's (an embedding may have fewer rows; names and shapes are checked before anything is copied).
    """
    targets = model.state_dict()
    sources = [(Path(model_dir(llm_dir)), "llm")]
    sources += [(Path(model_dir(vision_dir)), "vision")] if vision_dir is not None else []
    for directory, part in sources:
        shapes = hf_tensor_shapes(directory)
        mapping = map_keys(list(shapes), detect_prefixes(list(shapes), parts=(part,)), directory)
        wanted = {k for k in targets if k.startswith(part + ".") and not k.endswith("inv_freq")}
        if part == "llm" and model.cfg.llm.tie_word_embeddings:
            wanted.discard(TIED_HEAD_KEY)
        missing = sorted(wanted - set(mapping.values()))
        if missing:
            raise ValueError(f"{directory}: {len(missing)} {part} tensor(s) not found, e.g. {missing[:5]}")
        for key, name in mapping.items():
            if name in targets:
                check_shape(name, shapes[key], targets[name].shape, directory, grows=name in GROWN_KEYS)
        for key, tensor in iter_hf_tensors(directory):
            name = mapping.get(key)
            if name is None or name not in targets:
                continue
            target = targets[name]
            if name in GROWN_KEYS:
                tensor = grow_rows(tensor, target.shape[0])
            target.copy_(tensor)


def import_llm_and_vision(
    llm_dir: str | os.PathLike,
    vision_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    vision_select_layer: int | list[int] = -2,
    vision_select_feature: str = "patch",
    projector_type: str = "mlp2x_gelu",
    pad_vocab_multiple: int = 1,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Assemble a new neva checkpoint from an HF Llama and an HF CLIP or SigLIP (vision model or whole model).

    The projector is freshly initialised (seeded). ``<image>`` (and ``<pad>`` if missing) join the tokenizer as
    special tokens; the embedding and LM head grow to the new vocabulary, new rows set to the mean of the old ones.

    Args:
        llm_dir: HF ``LlamaForCausalLM`` directory with its tokenizer.
        vision_dir: HF ``CLIPVisionModel`` / ``CLIPModel`` / ``SiglipVisionModel`` / ``SiglipModel`` directory (the text
            tower, contrastive heads and SigLIP's pooling head are skipped).
        out: neva checkpoint directory to create.
        vision_select_layer: CLIP hidden state(s) fed to the projector (LLaVA ``mm_vision_select_layer``).
        vision_select_feature: ``patch`` (drop CLS) or ``cls_patch``.
        projector_type: ``linear``, ``identity`` or ``mlp{N}x_gelu``.
        pad_vocab_multiple: round the grown vocabulary up to a multiple of this (llava-hf used 64).
        seed: projector initialisation seed.
        dtype: cast everything to this dtype; None keeps the LLM's dtype for the projector and stored dtypes else.
        metadata: extra entries for the checkpoint's ``config.json``.
        max_shard_bytes: output shard size limit.
        overwrite: replace an existing ``out``.

    Returns:
        ``out``.
    """
    llm_dir, vision_dir = Path(model_dir(llm_dir)), Path(model_dir(vision_dir))
    llm = llm_config_from_hf(load_hf_config(llm_dir))
    vision = vision_config_from_hf(load_hf_config(vision_dir), vision_select_layer, vision_select_feature)
    tokenizer = prepare_tokenizer(llm_dir)
    vocab = max(llm.vocab_size, len(tokenizer))
    vocab = -(-vocab // pad_vocab_multiple) * pad_vocab_multiple
    projector = ProjectorConfig(type=projector_type, input_size=vision.feature_size, output_size=llm.hidden_size)
    cfg = NevaConfig(
        llm=dataclasses.replace(llm, vocab_size=vocab),
        vision=vision,
        projector=projector,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    cfg = with_image_stats(cfg, vision_dir)

    vision_shapes, llm_shapes = hf_tensor_shapes(vision_dir), hf_tensor_shapes(llm_dir)
    vision_map = map_keys(list(vision_shapes), detect_prefixes(list(vision_shapes), parts=("vision",)), vision_dir)
    llm_map = map_keys(list(llm_shapes), detect_prefixes(list(llm_shapes), parts=("llm",)), llm_dir)
    produced = {f"projector.{k}": tuple(t.shape) for k, t in build_projector(projector).state_dict().items()}
    produced.update({vision_map[k]: vision_shapes[k] for k in vision_map})
    produced.update({llm_map[k]: llm_shapes[k] for k in llm_map})
    check_complete(cfg, produced, f"{llm_dir} + {vision_dir}")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_hf_tensors(vision_dir):
            if key in vision_map:
                yield vision_map[key], cast_floating(tensor, dtype)
        llm_dtype = dtype
        for key, tensor in iter_hf_tensors(llm_dir):
            if key in llm_map:
                name = llm_map[key]
                if name in GROWN_KEYS:
                    tensor = grow_rows(tensor, vocab)
                llm_dtype = llm_dtype or tensor.dtype
                yield name, cast_floating(tensor, dtype)
        yield from _fresh_projector(projector, seed, llm_dtype)

    meta = {
        "source": {"kind": "llm+vision", "llm": str(llm_dir), "vision": str(vision_dir)},
        **(metadata or {}),
    }
    return save_checkpoint(
        out, cfg, tensors(), tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def _fresh_projector(cfg: ProjectorConfig, seed: int, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        module = build_projector(cfg)
        init_projector(module)
    for key, tensor in module.state_dict().items():
        yield f"projector.{key}", cast_floating(tensor, dtype)
